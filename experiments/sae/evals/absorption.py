"""Feature absorption (Chanin et al. 2024, "A is for Absorption"; SAEBench's `absorption`): where a linear probe
finds "starts with the letter L" in the activations of a word, does the SAE's own letter latent fire, or has another
latent (one for the word itself) absorbed the direction?

As SAEBench: the words are the tokens of the tokenizer that are letters alone (one leading space allowed), split
80/20; each is read at its own position in the prompt of 10 in-context examples, "{word} has the first letter: X",
then "{word} has the first letter:" (the word's id between the tokenized text around it, so the word stays one
token). A one-vs-rest logistic probe per letter on the activations (letters whose probe reaches F1 > 0.6 on the test
words count); the letter's main latents are the top k by class-mean difference, k grown from 1 while a logistic
probe on them gains more than 0.03 of F1 (up to 10); then, on the test words the probe finds, with p the probe's
unit direction, a = x . p, s_i = latent i's contribution to the reconstruction projected on p, and
c_i = cos(W_dec_i, p): the absorption fraction is 0 when the main latents' sum covers a or the 3 largest other
latents with c_i >= 0.1 cover less than 0.4 a (their sum: T), 1 when the main latents give nothing, else
min(T, a - main) / (min(T, a - main) + main); a word is fully absorbed when no main latent fires and the largest s_i,
of a latent with c_i >= 0.025, is >= 0.4 a.
Reported: the mean absorption fraction and full-absorption rate over letters, and the main latents per letter.

What is not SAEBench's: the activations are the SAE's own hook point (SAEBench reads blocks.L.hook_resid_post for
any SAE of layer L); the probes are L2 logistic regressions (C = 1, balanced classes, L-BFGS) where SAEBench trains
its letter probe with Adam for 50 epochs and ranks latents by an L1-penalised probe's weights; the words are at most
1000 (a seeded sample) and the split is seeded; fewer than 20 letters passing is said in a note, where SAEBench stops.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from torch import nn

from experiments.sae.evals.probes import fit_logistic
from experiments.sae.sources.pretrained import max_positions
from experiments.sae.sources.source import SourceModel

LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEMPLATE = "{word} has the first letter:"
WORDS, ICL, BATCH = 1000, 10, 32
MIN_F1, MIN_LETTERS, F1_JUMP, MAX_K = 0.6, 20, 0.03, 10
COS_ABSORBING, PROPORTION, ABSORBING, COS_FULL = 0.1, 0.4, 3, 0.025


def alpha_tokens(tokenizer: Any) -> list[tuple[int, str]]:
    """(id, text) of every token that is ASCII letters alone, after one optional leading space (SAEBench's vocab)."""
    special = set(tokenizer.all_special_ids)
    out = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        word = text[1:] if text.startswith(" ") else text
        if i not in special and word and word.isascii() and word.isalpha():
            out.append((i, text))
    return out


def _f1(predicted: torch.Tensor, truth: torch.Tensor) -> float:
    tp = (predicted & truth).sum().item()
    return 2 * tp / max(2 * tp + (predicted & ~truth).sum().item() + (~predicted & truth).sum().item(), 1)


def _prompts(
    tokenizer: Any, words: list[tuple[int, str]], pool: list[tuple[int, str]], bos: int | None, longest: int
) -> list[tuple[list[int], int]]:
    # per word: the prompt's ids and the word's position in them; in-context examples dropped from the front where
    # the prompt would be longer than the model's positions
    rng, encode = random.Random(0), lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    suffix = encode(TEMPLATE.format(word=""))  # " has the first letter:", after the word's own token
    out = []
    for word_id, _ in words:
        examples = rng.sample([w for w in pool if w[0] != word_id], min(ICL, len(pool) - 1))
        lines = [TEMPLATE.format(word=t) + " " + t.strip()[0].upper() for _, t in examples]
        while True:
            prefix = ([bos] if bos is not None else []) + encode("\n" + "\n".join(lines) + "\n")
            if len(prefix) + 1 + len(suffix) <= longest or not lines:
                break
            lines = lines[1:]
        out.append((prefix + [word_id] + suffix, len(prefix)))
    return out


@torch.no_grad()
def _activations(source: SourceModel, prompts: list[tuple[list[int], int]], pad: int) -> torch.Tensor:
    # the hooked module's output at each prompt's word; right-padded batches (a causal model: earlier positions
    # never see the padding)
    rows = []
    for start in range(0, len(prompts), BATCH):
        chunk = prompts[start : start + BATCH]
        width = max(len(ids) for ids, _ in chunk)
        tokens = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in chunk])
        out = source.output_of(source.name, tokens)
        rows.append(out[torch.arange(len(chunk)), torch.tensor([p for _, p in chunk])].float().cpu())
    return torch.cat(rows)


def _main_latents(codes: torch.Tensor, y: torch.Tensor, test_codes: torch.Tensor, test_y: torch.Tensor) -> list[int]:
    # SAEBench's split features: the top k latents (here by class-mean difference), k grown while F1 gains > 0.03
    diff = codes[y].mean(0) - codes[~y].mean(0)
    order = diff.argsort(descending=True)[:MAX_K]
    best, main = -100.0, []
    for k in range(1, MAX_K + 1):
        idx = order[:k]
        w, b = fit_logistic(codes[:, idx], y.long(), balanced=True)
        f1 = _f1(test_codes[:, idx].double() @ w + b > 0, test_y)
        if f1 <= best + F1_JUMP:
            break
        best, main = f1, idx.tolist()
    return main


def _absorbed(a: float, s: torch.Tensor, cos: torch.Tensor, codes: torch.Tensor, main: list[int]) -> tuple:
    # (absorption fraction, fully absorbed) of one word (SAEBench's FeatureAbsorptionCalculator)
    main_sum = s[main].sum().item()
    others = torch.ones_like(s, dtype=torch.bool)
    others[main] = False
    absorbing = s[others & (cos >= COS_ABSORBING) & (s > 0)]
    top = absorbing.topk(min(ABSORBING, len(absorbing))).values.sum().item() if len(absorbing) else 0.0
    if main_sum >= a or top / a < PROPORTION:
        fraction = 0.0
    elif main_sum <= 0:
        fraction = 1.0
    else:
        absorbed = min(top, a - main_sum)
        fraction = min(max(absorbed / (absorbed + main_sum), 0.0), 1.0)
    best = int(s.argmax())
    full = bool((codes[main] < 1e-8).all()) and cos[best] >= COS_FULL and a >= 0 and s[best].item() / a >= PROPORTION
    return fraction, full


def absorption(sae: nn.Module, source: SourceModel, working: Any = None) -> dict[str, Any]:
    """The feature absorption of `sae` on the first-letter task over its source's vocabulary."""
    started = time.perf_counter()
    hf = source.pretrained
    if hf is None or sae.transcoder:
        why = "a transcoder predicts another module's output" if sae.transcoder else "a byte-level model has no words"
        return {"skipped": f"feature absorption needs an SAE on a model whose tokenizer has words ({why})"}
    pool = alpha_tokens(hf.tokenizer)
    if len(pool) < 2 * ICL:
        return {"skipped": f"the tokenizer has {len(pool)} tokens of letters alone: too few for the task"}
    rng = random.Random(0)
    words = rng.sample(pool, min(WORDS, len(pool)))
    cut = int(0.8 * len(words))
    bos = hf.tokenizer.bos_token_id if hf.inputs.get("prepend_bos", True) else None
    pad = hf.tokenizer.pad_token_id if hf.tokenizer.pad_token_id is not None else hf.tokenizer.eos_token_id or 0
    longest = max_positions(hf.model.config) or 1 << 20
    prompts = _prompts(hf.tokenizer, words, pool, bos, longest)
    if max(len(ids) for ids, _ in prompts) > longest:
        return {"skipped": f"the model reads {longest} positions: too few for the prompt of one word"}
    x = _activations(source, prompts, pad)
    codes = sae.encode(x.to(sae.W_dec.device)).float().cpu()
    letters = torch.tensor([LETTERS.index(t.strip()[0].lower()) for _, t in words])
    W_dec = sae.W_dec.detach().float().cpu() / sae.out_scale.float().cpu()  # raw units: what one unit of code adds
    per_letter = {}
    for index, letter in enumerate(LETTERS):
        found = _letter(x, codes, letters == index, W_dec, cut)
        if found is None:
            continue
        per_letter[letter] = found
        if working is not None:
            working(index + 1, len(LETTERS))
    read = {"words": len(words), "positions": sum(len(ids) for ids, _ in prompts)}
    return _report(per_letter, read, started)


def _letter(x: torch.Tensor, codes: torch.Tensor, y: torch.Tensor, W_dec: torch.Tensor, cut: int) -> dict | None:
    # one letter's probe (words [:cut] train it, the rest test it), its main latents, and the absorption of the test
    # words the probe finds; None where the letter has too few words or its probe reaches no F1 > MIN_F1
    train, test = slice(0, cut), slice(cut, None)
    if y[train].sum() < 2 or y[test].sum() < 1:
        return None
    w, b = fit_logistic(x[train], y[train].long(), balanced=True)
    found = (x[test].double() @ w + b > 0).cpu()
    f1 = _f1(found, y[test])
    if f1 <= MIN_F1:
        return None
    main = _main_latents(codes[train], y[train], codes[test], y[test])
    direction = (w / w.norm()).float()
    cos = torch.nn.functional.normalize(W_dec, dim=1) @ direction
    hits = (found & y[test]).nonzero().squeeze(1)
    results = [
        _absorbed(
            float(x[test][i] @ direction),
            codes[test][i] * (W_dec @ direction),
            cos,
            codes[test][i],
            main,
        )
        for i in hits.tolist()
    ]
    return {
        "probe_f1": f1,
        "main_latents": main,
        "words": len(results),
        "absorption_fraction": sum(r[0] for r in results) / max(len(results), 1),
        "full_absorption_rate": sum(r[1] for r in results) / max(len(results), 1),
    }


def _report(per_letter: dict[str, dict], read: dict[str, int], started: float) -> dict[str, Any]:
    # the means over the letters whose probe passed, each letter's figures, and what the task read
    notes = []
    if len(per_letter) < MIN_LETTERS:
        notes.append(f"{len(per_letter)} letters' probes reach F1 > {MIN_F1} (SAEBench wants {MIN_LETTERS}): few")

    def mean(value: Any) -> float:
        return sum(value(v) for v in per_letter.values()) / len(per_letter) if per_letter else float("nan")

    return {
        "summary": {
            "mean_absorption_fraction": mean(lambda v: v["absorption_fraction"]),
            "mean_full_absorption": mean(lambda v: v["full_absorption_rate"]),
            "mean_num_main_latents": mean(lambda v: len(v["main_latents"])),
            "letters": len(per_letter),
        },
        "tasks": {letter: {k: v for k, v in r.items() if k != "main_latents"} for letter, r in per_letter.items()},
        "main_latents": {letter: r["main_latents"] for letter, r in per_letter.items()},
        "read": {**read, "seconds": round(time.perf_counter() - started, 2)},
        "notes": notes,
    }
