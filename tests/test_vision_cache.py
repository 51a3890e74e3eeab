"""The cache of processed vision-language samples (issue #32; `ligertune.data.vision`): written
once, read back tensor for tensor without opening an image, missed when an input changes,
bypassed with ``data.cache: false``, rebuilt when damaged, and built by ``ligertune preprocess``.
On the bundled quickstart-vl sample (56×56 images), cut to a few rows."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ligertune.config import load_recipe
from ligertune.data import load_tokenizer
from ligertune.data.vision import build_vision_datasets, load_processor
from ligertune.errors import DataError
from ligertune.models.build import tokens_per_image, vision_tower
from ligertune.models.config import build_config
from ligertune.paths import ASSETS_DIR
from tests.helpers import ROOT

QUICKSTART_VL = ROOT / "recipes" / "quickstart-vl.yaml"
QUICKSTART_VL_MLLAMA = ROOT / "recipes" / "quickstart-vl-mllama.yaml"
ROWS = 6


@pytest.fixture
def sample(tmp_path):
    """The bundled rows and their images, copied where the test may change them."""
    shutil.copytree(ASSETS_DIR / "vl_images", tmp_path / "vl_images")
    lines = (ASSETS_DIR / "vl_sample.jsonl").read_text().splitlines()[:ROWS]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _build(tmp_path, sample, *overrides: str, path=QUICKSTART_VL):
    recipe = load_recipe(
        path,
        [f"data.path={sample}", f"data.cache_dir={tmp_path / 'cache'}", "data.shuffle=false", *overrides],
    )
    vision = vision_tower(recipe)
    processor = load_processor(
        recipe, vision, load_tokenizer(recipe), tokens_per_image(build_config(recipe), vision)
    )
    lines: list[str] = []
    return build_vision_datasets(recipe, processor, log=lines.append), "\n".join(lines)


def _images(sample) -> list:
    return sorted((sample.parent / "vl_images").glob("*.png"))[:ROWS]


def _assert_same(first, second) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert sorted(a) == sorted(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_a_second_build_reads_the_same_tensors_from_the_cache_without_opening_an_image(tmp_path, sample):
    first, log = _build(tmp_path, sample, "data.validation_fraction=0.3")
    assert "processed 6 rows with" in log and "cached the processed samples at" in log
    assert first.cache_dir is not None and first.cache_dir.parent == tmp_path / "cache"

    # Every image overwritten with garbage of its size and modification time: the key (which
    # stats the files) is unchanged, and opening any of them would fail.
    for image in _images(sample):
        stat = image.stat()
        image.write_bytes(b"\0" * stat.st_size)
        os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second, log = _build(tmp_path, sample, "data.validation_fraction=0.3")
    assert f"loaded 6 processed samples from cache {first.cache_dir}" in log and "processed 6 rows" not in log
    assert second.cache_dir == first.cache_dir and second.fingerprint == first.fingerprint
    assert len(second.train) == 4 and len(second.validation) == 2
    _assert_same(first.train, second.train)
    _assert_same(first.validation, second.validation)
    assert second.report() == first.report()

    # data.cache: false reads the images again (and now finds them broken), writing nothing.
    with pytest.raises(DataError, match="rows.jsonl, row 0: image vl_images/00.png: cannot be read"):
        _build(tmp_path, sample, "data.validation_fraction=0.3", "data.cache=false")


def test_llama_32_visions_tiles_and_spans_come_back_from_the_cache(tmp_path, sample):
    """Its samples' tensors (tiles [images, tiles, 3, H, W], aspect ratio ids and mask, the
    cross-attention spans) are stored by name as any others: the second build reads them back."""
    first, _ = _build(tmp_path, sample, path=QUICKSTART_VL_MLLAMA)
    assert {"pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_spans"} <= set(
        first.train[0]
    )
    second, log = _build(tmp_path, sample, path=QUICKSTART_VL_MLLAMA)
    assert "loaded 6 processed samples from cache" in log
    _assert_same(first.train, second.train)


def test_cache_off_builds_in_memory_and_writes_nothing(tmp_path, sample):
    prepared, log = _build(tmp_path, sample, "data.cache=false")
    assert prepared.cache_dir is None and not (tmp_path / "cache").exists()
    assert "processed 6 rows with 6 images" in log and "cache" not in log
    cached, _ = _build(tmp_path, sample)
    _assert_same(prepared.train, cached.train)
    assert prepared.fingerprint == cached.fingerprint


def test_what_changes_the_samples_misses_the_cache(tmp_path, sample):
    base, _ = _build(tmp_path, sample)
    entries = {base.cache_dir}

    def misses(*overrides: str):
        prepared, log = _build(tmp_path, sample, *overrides)
        assert "cached the processed samples at" in log, overrides
        assert prepared.cache_dir not in entries, overrides
        entries.add(prepared.cache_dir)
        return prepared

    small = misses("data.image_min_pixels=784", "data.image_max_pixels=784")  # 28×28: 4 patches, not 16
    assert small.train[0]["pixel_values"].shape[0] == 4
    misses("data.max_seq_len=96")
    misses("data.skip_bad_images=true")
    misses("data.validation_fraction=0.5")

    # The processor: another image normalisation in preprocessor_config.json, then an edited chat template.
    processor = sample.parent / "processor"
    shutil.copytree(ASSETS_DIR / "vl_processor", processor)
    config = json.loads((processor / "preprocessor_config.json").read_text())
    config["image_mean"] = [0.5, 0.5, 0.5]
    (processor / "preprocessor_config.json").write_text(json.dumps(config))
    other = misses(f"tokenizer.name_or_path={processor}")
    assert not torch.equal(other.train[0]["pixel_values"], base.train[0]["pixel_values"])
    template = processor / "chat_template.jinja"
    template.write_text(template.read_text() + "{# edited #}")
    misses(f"tokenizer.name_or_path={processor}")

    again, log = _build(tmp_path, sample, "data.max_seq_len=96")  # each entry stays valid
    assert "loaded 6 processed samples from cache" in log and again.cache_dir in entries

    # An image replaced under the same name (a new modification time).
    image = _images(sample)[0]
    stat = image.stat()
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    misses()


def test_a_damaged_entry_is_reported_and_rebuilt(tmp_path, sample):
    first, _ = _build(tmp_path, sample)
    split = first.cache_dir / "train.safetensors"
    split.write_bytes(split.read_bytes()[:-8])
    second, log = _build(tmp_path, sample)
    assert f"the data cache entry {first.cache_dir} is damaged" in log and "rebuilding it" in log
    assert "cached the processed samples at" in log
    _assert_same(first.train, second.train)


def test_preprocess_builds_the_entry_a_training_run_then_loads(tmp_path, sample):
    from typer.testing import CliRunner

    from ligertune.cli import app

    args = [
        "preprocess",
        str(QUICKSTART_VL),
        f"data.path={sample}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.shuffle=false",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "processed 6 rows with 6 images" in result.output and "cached: " in result.output
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and "already cached: " in result.output
    _, log = _build(tmp_path, sample)
    assert "loaded 6 processed samples from cache" in log
