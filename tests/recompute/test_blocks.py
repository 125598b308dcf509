"""Finding a model's repeated blocks: Hugging Face _no_split_modules, the largest uniform
nn.ModuleList, or what the user names; errors that say what blocks= accepts; parameters shared
between blocks, or between a block and the rest of the model, are found."""
from __future__ import annotations

import pytest
import torch.nn as nn

from _models import TModel
from chameleon_swap.recompute.blocks import check_unshared, find_blocks
from chameleon_swap.workloads import get_workload


def _model(name: str) -> nn.Module:
    return get_workload(name, "tiny").build("cpu")


def test_find_blocks_uses_hugging_face_no_split_modules():
    model = _model("hf:llama")
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    assert blocks == list(model.model.layers)
    assert find_blocks(model, "model.layers") == blocks


def test_find_blocks_falls_back_to_the_largest_uniform_module_list():
    model = _model("moe")           # 2 layers, each with a longer list of 4 experts
    assert find_blocks(model) == list(model.layers)
    t = TModel()
    assert find_blocks(t) == list(t.layers)


def test_find_blocks_given_explicitly():
    t = TModel()
    assert find_blocks(t, "layers") == list(t.layers)
    assert find_blocks(t, [t.layers[2], t.layers[0]]) == [t.layers[2], t.layers[0]]
    assert find_blocks(t, (t.layers[1],)) == [t.layers[1]]
    assert find_blocks(t, t.layers) == list(t.layers)


def test_find_blocks_outermost_matches_only():
    class Inner(nn.Linear):
        pass

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Inner(2, 2), Inner(2, 2)

    class M(nn.Module):
        _no_split_modules = ["Outer", "Inner"]

        def __init__(self):
            super().__init__()
            self.first = Inner(2, 2)
            self.rest = nn.ModuleList([Outer(), Outer()])

    m = M()
    assert find_blocks(m) == [m.first, m.rest[0], m.rest[1]]


@pytest.mark.parametrize("blocks, error, words", [
    ("nope", ValueError, "blocks='nope' names no submodule"),
    ("head", ValueError, "is a Linear, not an nn.ModuleList"),
    ([nn.Linear(2, 2)], ValueError, "not a submodule"),
    ([], ValueError, "holds no modules"),
    (42, TypeError, "blocks must be None"),
    (["layers"], TypeError, "must hold nn.Module objects"),
])
def test_find_blocks_errors_name_the_argument(blocks, error, words):
    with pytest.raises(error, match=words):
        find_blocks(TModel(), blocks)


def test_find_blocks_rejects_nesting_duplicates_and_models_without_blocks():
    t = TModel()
    with pytest.raises(ValueError, match="must not nest"):
        find_blocks(t, [t.layers[0], t.layers[0].fc1])
    with pytest.raises(ValueError, match="twice"):
        find_blocks(t, [t.layers[0], t.layers[0]])
    with pytest.raises(ValueError, match="blocks=None found no blocks in Linear"):
        find_blocks(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        find_blocks("model")


def test_check_unshared_finds_tied_weights():
    def net():
        return nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(3, 3) for _ in range(3)),
                              "head": nn.Linear(3, 3)})
    m = net()
    check_unshared(list(m["layers"]), m)                      # nothing shared: no error
    m["layers"][2].weight = m["layers"][0].weight
    with pytest.raises(ValueError, match="blocks 0 and 2 share a parameter"):
        check_unshared(list(m["layers"]))
    m = net()
    m["head"].weight = m["layers"][1].weight
    check_unshared(list(m["layers"]))                         # without the model: unseen
    with pytest.raises(ValueError, match=r"model\.head\.weight shares its storage .* block 1"):
        check_unshared(list(m["layers"]), m)
