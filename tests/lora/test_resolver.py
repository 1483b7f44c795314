"""loraserve.lora.resolver: which adapter folders a name or a path may reach (no model needed)."""
from __future__ import annotations

import os

import pytest

from loraserve.errors import InvalidRequestError, UnknownLoRAError
from loraserve.lora.resolver import (
    LoRAPathOutsideRootError,
    is_inside,
    resolve_adapter_name,
    resolve_adapter_path,
)


def _adapter(folder) -> str:
    os.makedirs(folder)
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        with open(os.path.join(folder, file), "w") as f:
            f.write("{}")
    return os.path.realpath(folder)


@pytest.fixture
def roots(tmp_path):
    first, second, outside = tmp_path / "first", tmp_path / "second", tmp_path / "outside"
    paths = {"a": _adapter(first / "a"), "nested": _adapter(first / "team" / "b"), "c": _adapter(second / "c"),
             "evil": _adapter(outside / "evil")}
    os.symlink(paths["evil"], first / "out")
    os.symlink(first, first / "self")
    os.symlink(first / "a", first / "alias")
    return str(first), str(second), paths


def test_is_inside_compares_whole_path_parts():
    assert is_inside("/srv/loras/a", "/srv/loras") and is_inside("/srv/loras", "/srv/loras")
    assert not is_inside("/srv/loras-other/a", "/srv/loras") and not is_inside("/srv", "/srv/loras")


def test_names(roots, tmp_path):
    first, _, paths = roots
    assert resolve_adapter_name("a", first) == paths["a"]
    assert resolve_adapter_name("team/b", first) == paths["nested"]
    assert resolve_adapter_name("alias", first) == paths["a"]  # a symlink that stays inside
    os.symlink(first, tmp_path / "root-link")
    assert resolve_adapter_name("a", str(tmp_path / "root-link")) == paths["a"]  # the root itself may be a link
    with pytest.raises(UnknownLoRAError, match="'missing'"):
        resolve_adapter_name("missing", first)
    for name, message in (("../outside/evil", "'..' part"), ("a/", "empty"), (paths["a"], "absolute path"),
                          ("out", "resolves outside"), ("self", "the lora root itself")):
        with pytest.raises(LoRAPathOutsideRootError, match=message):
            resolve_adapter_name(name, first)
    with pytest.raises(InvalidRequestError, match="NUL"):
        resolve_adapter_name("a\0b", first)


def test_paths_across_several_roots(roots):
    first, second, paths = roots
    assert resolve_adapter_path("a", [first, second]) == paths["a"]  # relative: from the first root
    assert resolve_adapter_path(paths["c"], [first, second]) == paths["c"]
    for path in (paths["evil"], os.path.join(first, "..", "outside", "evil"), os.path.join(first, "out")):
        with pytest.raises(LoRAPathOutsideRootError, match="outside every lora root"):
            resolve_adapter_path(path, [first, second])
    with pytest.raises(InvalidRequestError, match="not a directory"):
        resolve_adapter_path("missing", [first])
    with pytest.raises(LoRAPathOutsideRootError):
        resolve_adapter_path("a", [])
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        resolve_adapter_path("", [first])


def test_every_entry_must_stay_inside_and_the_files_must_be_there(roots):
    first, _, paths = roots
    os.remove(os.path.join(paths["a"], "adapter_model.safetensors"))
    with open(os.path.join(paths["a"], "adapter_model.bin"), "wb") as f:
        f.write(b"pickle")
    for resolve in (lambda: resolve_adapter_name("a", first), lambda: resolve_adapter_path("a", [first])):
        with pytest.raises(InvalidRequestError, match="no adapter_model.safetensors") as info:
            resolve()
        assert not isinstance(info.value, LoRAPathOutsideRootError)
    os.symlink(os.path.join(paths["evil"], "adapter_model.safetensors"),
               os.path.join(paths["a"], "adapter_model.safetensors"))
    with pytest.raises(LoRAPathOutsideRootError, match="'adapter_model.safetensors' in .* links outside"):
        resolve_adapter_name("a", first)
    os.remove(os.path.join(paths["nested"], "adapter_config.json"))
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        resolve_adapter_name("team/b", first)
