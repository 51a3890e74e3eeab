# Sourced by the GPU runner scripts (scripts/gpu_*.sh).
# report_header TITLE: the head of a run's summary.md on stdout: the title with the UTC time and
# commit, then the GPUs and package versions in a code block. Uses $PYTHON.
report_header() {
  echo "# $1, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo '```'
  nvidia-smi -L
  "$PYTHON" -c 'from ligertune.tools.env import describe_environment as d; [print(f"{k}: {v}") for k, v in d().items()]'
  echo '```'
  echo
}

# report_tables DIR NAME...: each e2e_bench table DIR/NAME/e2e.md under a heading, or the tail of
# DIR/NAME.log where the bench wrote none (it failed, or was stopped).
report_tables() {
  local dir=$1 name
  shift
  for name in "$@"; do
    echo; echo "## $name"; echo
    cat "$dir/$name/e2e.md" 2>/dev/null || { echo "no table; log tail:"; tail -n 20 "$dir/$name.log"; }
  done
}
