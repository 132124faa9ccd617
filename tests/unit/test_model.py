from __future__ import annotations

import pytest
import torch

from atomd.model import GPT, GPTConfig, get_preset, lm_loss
from atomd.model.config import num_parameters
from atomd.model.presets import PAPER_PARAMETERS, PRESETS
from atomd.model.sample import generate


@pytest.mark.parametrize("name", sorted(PAPER_PARAMETERS))
def test_preset_parameter_count_matches_paper(name: str) -> None:
    with torch.device("meta"):  # no memory is spent, even for 13B
        n = GPT(get_preset(name)).num_parameters()
    assert abs(n - PAPER_PARAMETERS[name]) / PAPER_PARAMETERS[name] < 0.03, n


@pytest.mark.parametrize(
    "cfg",
    [
        *PRESETS.values(),
        GPTConfig(n_layer=2, n_head=2, n_embd=64, bias=False),
        GPTConfig(n_layer=3, n_head=2, n_embd=32, tie_embeddings=False, block_size=16),
    ],
)
def test_closed_form_parameter_count_matches_the_model(cfg: GPTConfig) -> None:
    with torch.device("meta"):
        assert num_parameters(cfg) == GPT(cfg).num_parameters()


def test_tiny_is_about_one_million_parameters() -> None:
    n = GPT(get_preset("tiny")).num_parameters()
    assert 0.5e6 < n < 1.5e6


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known presets: tiny"):
        get_preset("gpt5")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_layer": 2, "n_head": 3, "n_embd": 64}, "divisible"),
        ({"n_layer": 0, "n_head": 2, "n_embd": 64}, "n_layer must be positive"),
        ({"n_layer": 2, "n_head": 2, "n_embd": 64, "dropout": 1.0}, "dropout"),
    ],
)
def test_config_validation(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_layers_in_order_compute_the_forward() -> None:
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"))
    layers = model.layers()
    assert len(layers) == model.config.n_layer + 2
    assert layers[0] is model.embed and layers[-1] is model.head
    idx = torch.randint(0, 256, (2, 16))
    x = idx
    for layer in layers:
        x = layer(x)
    logits, _ = model(idx)
    assert logits.shape == (2, 16, 256)
    torch.testing.assert_close(x, logits, rtol=0, atol=0)


def test_tied_embedding_is_one_parameter() -> None:
    model = GPT(get_preset("tiny"))
    assert model.head.lm_head.weight is model.embed.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.lm_head.weight" not in names
    untied = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, tie_embeddings=False))
    assert untied.head.lm_head.weight is not untied.embed.wte.weight


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(get_preset("tiny")).eval()
    a = torch.randint(0, 256, (1, 20))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256  # change only the future
    la, _ = model(a)
    lb, _ = model(b)
    torch.testing.assert_close(la[:, :10], lb[:, :10])
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


def test_initial_loss_is_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"))
    idx = torch.randint(0, 256, (4, 32))
    targets = torch.randint(0, 256, (4, 32))
    _, loss = model(idx, targets)
    assert loss is not None
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3


def test_too_long_sequence_is_refused() -> None:
    model = GPT(get_preset("tiny"))
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_generate_extends_and_is_seeded() -> None:
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"))
    idx = torch.tensor([[65, 66]])
    out1 = generate(model, idx, 10, generator=torch.Generator().manual_seed(1))
    out2 = generate(model, idx, 10, generator=torch.Generator().manual_seed(1))
    assert out1.shape == (1, 12)
    assert torch.equal(out1, out2)
    assert torch.equal(out1[:, :2], idx)


def test_lm_loss_matches_cross_entropy() -> None:
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    want = torch.nn.functional.cross_entropy(logits.reshape(6, 5), targets.reshape(6))
    torch.testing.assert_close(lm_loss(logits, targets), want)


def test_every_preset_is_listed() -> None:
    assert set(PRESETS) == {"tiny", "small", "gpt3-xl", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b"}
