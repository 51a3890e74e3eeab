# Sourced by the GPU runner scripts (gpu_check.sh, gpu_single.sh, gpu_distributed.sh, gpu_step.sh).
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
