"""Sparse probing (SAEBench's `sparse_probing`, on labels the text itself gives, with no download): how well k latents
of the SAE, picked by the difference of their class means, predict a property, against k dimensions of the raw
activations picked the same way and a probe on all of them.

The text is Python source (held-out files of the standard library: every 20th, what runner's language models and a
transformers source hold out by default; the first windows of each, as many from each as the budget allows), labelled
by Python's own `tokenize`: per position, whether the token is inside a string, a comment, a number or a keyword (its
first non-space character's category), and per window, which of the 5 largest files it came from (up to 250 windows
each) (activations and codes mean-pooled over the window's positions, as SAEBench pools a text). Each property is
one-vs- rest, balanced (SAEBench's `prepare_probe_data`): up to 4000 training and 1000 test examples, split by file
for the positions (no file's tokens on both sides) and at random for the windows. The probe is SAEBench's: L2
logistic regression with C = 1 on the k columns, k in 1, 2, 5, 20; each task's accuracies are its test split's. What
is not SAEBench's: its 8 hub datasets (bios, reviews, code, news, languages) are replaced by these tasks, and its
probe on all dimensions (a GPU probe whose epoch is chosen on the test split) by the same logistic regression on all
of them (`llm_full`).
"""

from __future__ import annotations

import io
import keyword
import time
import tokenize
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from experiments.lm.corpus import read_text, stdlib_sources
from experiments.sae.evals.probes import fit_logistic
from experiments.sae.sources.source import SourceModel
from runner import ConfigError
from runner.data import to_device

K = (1, 2, 5, 20)
CATEGORIES = ("string", "comment", "number", "keyword")  # 0 is everything else
TRAIN, TEST, FILES, FILE_WINDOWS = 4000, 1000, 5, 250
KEEP = 0.25  # of a window's positions, kept as probing examples (the rest would only be subsampled away)
STRINGS = {
    tokenize.STRING,
    *(getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, n)),
}


def char_categories(text: str) -> np.ndarray | None:
    """Per character of Python source, its token's category (1 + CATEGORIES' index, 0 other); None if it does not
    tokenize."""
    starts = np.cumsum([0] + [len(line) for line in text.splitlines(keepends=True)])
    out = np.zeros(len(text), dtype=np.int8)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            kind = (
                1
                if tok.type in STRINGS
                else 2
                if tok.type == tokenize.COMMENT
                else 3
                if tok.type == tokenize.NUMBER
                else 4
                if tok.type == tokenize.NAME and keyword.iskeyword(tok.string)
                else 0
            )
            if kind:
                (r0, c0), (r1, c1) = tok.start, tok.end
                out[starts[r0 - 1] + c0 : starts[r1 - 1] + c1] = kind
    except (tokenize.TokenError, SyntaxError, IndexError):
        return None
    return out


def _encoder(source: SourceModel) -> tuple[Callable[[str], tuple[list[int], list[int]]], int, int | None]:
    # (text -> (token ids, each token's first character), context, BOS id or None) of the source's tokenizer
    hf = source.pretrained
    if hf is not None:
        tokenizer, bos = hf.tokenizer, hf.tokenizer.bos_token_id if hf.inputs.get("prepend_bos", True) else None
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("sparse probing labels tokens by their place in the text: it needs a fast tokenizer")

        def encode(text: str) -> tuple[list[int], list[int]]:
            got = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
            firsts = []
            for start, end in got["offset_mapping"]:
                piece = text[start:end]
                firsts.append(start + (len(piece) - len(piece.lstrip())) if piece.strip() else -1)
            return got["input_ids"], firsts

        return encode, int(hf.inputs.get("context", 128)) - (bos is not None), bos
    if getattr(source.model, "vocab_size", None) != 256:
        raise ConfigError(
            "sparse probing reads text through the source's tokenizer: a byte-level runner GPT (vocab 256) or a "
            "transformers model; this source has neither"
        )

    def encode_bytes(text: str) -> tuple[list[int], list[int]]:
        data = text.encode()
        owner = np.repeat(np.arange(len(text)), [len(c.encode()) for c in text])  # each byte's character
        return list(data), [int(i) if not text[i].isspace() else -1 for i in owner]

    return encode_bytes, int(source.model.seq_len), None


def _windows(source: SourceModel, tokens: int) -> list[dict[str, Any]]:
    # the held-out files cut into windows of the source's context: token ids [T + 1] and labels of the T inputs; the
    # first windows of every file (the `tokens` budget shared out), and up to FILE_WINDOWS of the FILES largest
    # (half the budget again), the window task's classes
    encode, context, bos = _encoder(source)
    files = stdlib_sources()[19::20]
    per_file = -(-tokens // (context * len(files)))
    largest = set(sorted(range(len(files)), key=lambda i: -files[i].stat().st_size)[:FILES])
    out = []
    for index, path in enumerate(files):
        text = read_text(path).decode()
        cats = char_categories(text)
        if cats is None:
            continue
        ids, firsts = encode(text)
        labels = [int(cats[f]) if f >= 0 else 0 for f in firsts]
        # half the budget more for the largest files, whose windows the window task's classes are
        take = max(per_file, min(FILE_WINDOWS, tokens // (2 * context * FILES))) if index in largest else per_file
        for start in range(0, len(ids) - context, context)[:take]:
            window = ids[start : start + context + 1]
            label = labels[start : start + context]
            if bos is not None:
                window, label = [bos, *window[:-1]], [0, *label[:-1]]
            out.append({"tokens": window, "labels": label, "file": index, "name": str(Path(path).name)})
    return out


def _sparse(values: torch.Tensor, indices: torch.Tensor | None, n: int) -> torch.Tensor:
    # codes as a sparse [rows, n_latents] matrix (float64), whatever their shape
    if indices is None:
        return values.double().to_sparse()
    rows = torch.arange(len(values), device=values.device)[:, None].expand_as(indices)
    keep = values != 0
    coo = torch.stack([rows[keep], indices[keep]])
    return torch.sparse_coo_tensor(coo, values[keep].double(), (len(values), n), check_invariants=False).coalesce()


@torch.no_grad()
def _features(sae: nn.Module, source: SourceModel, windows: list[dict[str, Any]], working: Any) -> dict[str, Any]:
    # per kept position (a KEEP share): raw activations, sparse codes, label, file; per window: their means
    gen = torch.Generator().manual_seed(0)
    pos = {"x": [], "codes": [], "label": [], "file": []}
    win = {"x": [], "codes": [], "file": []}
    for done, start in enumerate(range(0, len(windows), 32), 1):
        chunk = windows[start : start + 32]
        batch = {"tokens": torch.tensor([w["tokens"] for w in chunk], dtype=torch.long)}
        mask = source.row_mask(batch)
        rows = source.activations(to_device(batch, source.device))
        x = sae.split(rows.float())[0] if sae.transcoder else rows.float()
        values, indices = sae.codes(x)
        codes = _sparse(values, indices, sae.n_latents).cpu()
        labels = torch.tensor([w["labels"] for w in chunk])[mask]
        owner = torch.arange(len(chunk))[:, None].expand_as(mask)[mask]
        count = torch.bincount(owner, minlength=len(chunk)).double().clamp_min(1)[:, None]
        win["x"].append(
            torch.zeros(len(chunk), x.shape[1], dtype=torch.float64).index_add_(0, owner, x.double().cpu()) / count
        )
        pooled = torch.sparse.mm(
            torch.sparse_coo_tensor(
                torch.stack([owner, torch.arange(len(owner))]), 1 / count[owner, 0], (len(chunk), len(owner))
            ),
            codes,
        )
        win["codes"].append(pooled.coalesce())
        win["file"].append(torch.tensor([w["file"] for w in chunk]))
        kept = (torch.rand(len(labels), generator=gen) < KEEP).nonzero().squeeze(1)
        pos["x"].append(x.cpu()[kept])
        pos["codes"].append(codes.index_select(0, kept))
        pos["label"].append(labels[kept])
        pos["file"].append(torch.tensor([w["file"] for w in chunk])[owner][kept])
        if working is not None:
            working(done, -(-len(windows) // 32))
    cat = lambda parts: torch.cat(parts) if parts[0].layout == torch.strided else torch.cat(parts).coalesce()  # noqa: E731
    return {"positions": {k: cat(v) for k, v in pos.items()}, "windows": {k: cat(v) for k, v in win.items()}}


def _balanced(positive: torch.Tensor, negative: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor | None:
    # indices of `size` examples, half from each side (None: too few of either for a task)
    half = min(size // 2, len(positive), len(negative))
    if half < 10:
        return None
    pick = lambda idx: idx[torch.randperm(len(idx), generator=gen)[:half]]  # noqa: E731
    both = torch.cat([pick(positive), pick(negative)])
    return both[torch.randperm(len(both), generator=gen)]


def _columns(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return (x.index_select(1, idx).to_dense() if x.layout != torch.strided else x[:, idx]).double()


def _task(features: dict[str, torch.Tensor], y: torch.Tensor, train: torch.Tensor, test: torch.Tensor) -> dict:
    # one-vs-rest accuracies: top-k SAE latents, top-k raw dimensions, all raw dimensions
    out: dict[str, float] = {}
    for name in ("codes", "x"):
        x = features[name]
        xtr = x.index_select(0, train)
        ones = y[train].double()
        if xtr.layout == torch.strided:
            means = torch.stack(
                [
                    (xtr.double() * ones[:, None]).sum(0) / ones.sum(),
                    (xtr.double() * (1 - ones)[:, None]).sum(0) / (1 - ones).sum(),
                ]
            )
        else:
            sums = torch.sparse.mm(xtr.t(), torch.stack([ones, 1 - ones], 1)).t()
            means = sums / torch.stack([ones.sum(), (1 - ones).sum()])[:, None]
        order = (means[0] - means[1]).abs().argsort(descending=True)
        for k in K:
            idx = order[:k]
            w, b = fit_logistic(_columns(xtr, idx), y[train])
            xte = _columns(x.index_select(0, test), idx)
            out[f"{'sae' if name == 'codes' else 'llm'}_top_{k}_test_accuracy"] = (
                ((xte @ w + b > 0) == y[test].bool()).double().mean().item()
            )
    w, b = fit_logistic(features["x"][train], y[train])
    out["llm_full_test_accuracy"] = (
        ((features["x"][test].double() @ w + b > 0) == y[test].bool()).double().mean().item()
    )
    out["train"], out["test"] = len(train), len(test)
    return out


def sparse_probing(sae: nn.Module, source: SourceModel, tokens: int, working: Any = None) -> dict[str, Any]:
    """SAEBench-style sparse probing of `sae` on up to `tokens` positions of held-out Python source."""
    started = time.perf_counter()
    sae.eval()
    windows = _windows(source, tokens)
    if not windows:
        raise ConfigError("sparse probing found no held-out Python file long enough for one window of the source")
    with warnings.catch_warnings():  # torch's notes that its sparse tensors are in beta, once per process
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        feats = _features(sae, source, windows, working)
    gen = torch.Generator().manual_seed(0)
    tasks, notes = {}, []
    positions, files = feats["positions"], feats["positions"]["file"]
    test_files = files % 5 == 4  # a fifth of the files for testing
    for index, name in enumerate(CATEGORIES, 1):
        y = (positions["label"] == index).long()
        sides = [((y == 1) & ~test_files), ((y == 0) & ~test_files), ((y == 1) & test_files), ((y == 0) & test_files)]
        train = _balanced(sides[0].nonzero().squeeze(1), sides[1].nonzero().squeeze(1), TRAIN, gen)
        test = _balanced(sides[2].nonzero().squeeze(1), sides[3].nonzero().squeeze(1), TEST, gen)
        if train is None or test is None:
            notes.append(f"{name}: too few positions of one class for a probe (read more tokens=)")
            continue
        tasks[f"token_{name}"] = _task(positions, y, train, test)
    pooled = feats["windows"]
    common = torch.bincount(pooled["file"]).argsort(descending=True)[:FILES]
    split = torch.rand(len(pooled["file"]), generator=gen) < 0.8
    for rank, file in enumerate(common.tolist()):
        y = (pooled["file"] == file).long()
        train = _balanced((y.bool() & split).nonzero().squeeze(1), (~y.bool() & split).nonzero().squeeze(1), TRAIN, gen)
        test = _balanced((y.bool() & ~split).nonzero().squeeze(1), (~y.bool() & ~split).nonzero().squeeze(1), TEST, gen)
        name = next(w["name"] for w in windows if w["file"] == file)
        if train is None or test is None:
            notes.append(f"file {name}: too few windows for a probe")
            continue
        tasks[f"window_file{rank}_{name}"] = _task(pooled, y, train, test)
    if not tasks:
        raise ConfigError("sparse probing had too few examples of every class: give more tokens=")
    summary = {
        key: float(np.mean([t[key] for t in tasks.values()]))
        for key in next(iter(tasks.values()))
        if key.endswith("accuracy")
    }
    seconds = round(time.perf_counter() - started, 2)
    read = {"windows": len(windows), "positions": int(sum(len(w["labels"]) for w in windows)), "seconds": seconds}
    return {"summary": summary, "tasks": tasks, "read": read, "notes": notes}
