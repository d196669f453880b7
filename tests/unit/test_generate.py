"""Text from a trained GPT: the KV-cache path gives the uncached path's tokens, seeded samples repeat, and
`python -m runner.generate` prints them (or one line and exit code 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments.lm.model import GPT
from runner.tools.generate import main


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32).eval()


@pytest.mark.parametrize("top_k", [1, 40, None], ids=["greedy", "top-40", "no-cut"])
def test_the_kv_cache_gives_the_uncached_tokens_inside_and_past_the_window(top_k: int | None) -> None:
    # a 5-token prompt and 20 new tokens in a 16-token window: cached while it fits, sliding after
    model, prompt = _gpt(), torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1))
    runs = [
        model.generate(prompt, 20, 0.8, top_k, torch.Generator().manual_seed(2), use_cache=cached)
        for cached in (True, False)
    ]
    assert runs[0].shape == (3, 25) and torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0][:, :5], prompt)


def test_the_cached_logits_are_the_full_forward_s() -> None:
    from experiments.lm.model import LayerCache

    model, tokens = _gpt(), torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        cache = [LayerCache(model.seq_len) for _ in model.blocks]
        steps = [model(tokens[:, :4], cache)] + [model(tokens[:, i : i + 1], cache) for i in range(4, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one token at a time"):
        model(tokens[:, :2], cache)  # a chunk after the prompt: not what the cache serves


def test_the_command_prints_seeded_samples_and_refuses_bad_arguments(
    lm_run: Path, capsys: pytest.CaptureFixture
) -> None:
    args = [str(lm_run), "prompt=def ", "max_new_tokens=12", "num_samples=2", "seed=3"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert first.out.count("=== sample") == 2 and first.out.count("def ") >= 2
    assert "24 tokens in" in first.err and "tokens/s on cpu" in first.err
    assert main(args) == 0
    assert capsys.readouterr().out == first.out  # the same seed, the same text
    assert main([*args[:-1], "seed=4"]) == 0
    assert capsys.readouterr().out != first.out
    for bad, message in [
        ("temperature=0", "temperature=0: give a number > 0"),
        ("max_new_tokens=-1", "max_new_tokens=-1: give a whole number >= 1"),
        ("top_k=0", "top_k=0: give a whole number >= 1"),
        ("prompt_ids=[300]", "below vocab_size 256"),
        ("colour=red", "'colour=red': give KEY=VALUE"),
        ("prompt_ids=[1,", "prompt_ids=[1,: cannot read the value"),
        ("device=cuda:7", "device=cuda:7: this machine has"),
        ("seed=18446744073709551616", "seed=18446744073709551616: give a whole number in [0, 2**64 - 1]"),
    ]:
        assert main([str(lm_run), bad]) == 2, bad
        assert message in capsys.readouterr().err, bad
    assert main(["prompt=x"]) == 2 and "usage: python -m runner.generate RUN_DIR" in capsys.readouterr().err
