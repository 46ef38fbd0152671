"""Every causal-LM family transformers ships, at a small size: the family test's material.

:func:`families` enumerates ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (transformers' own list,
not a hand list); :func:`tiny_config` builds each family's config with small sizes through
the names its config class takes (``attribute_map`` translates ``hidden_size`` to
``n_embd``...) and every dropout and router jitter at 0 (random draws cannot agree between
two runs that draw in different orders); :func:`build` returns the model or why it does not build small.
:func:`render` writes docs/hf.md's table of families from the test's results file.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "tests" / "fixtures" / "hf_families.json"
DOC = ROOT / "docs" / "hf.md"
BEGIN, END = "<!-- families: begin (generated) -->", "<!-- families: end -->"
VOCAB, LAYERS = 64, 4
#: the largest model that counts as small (a family whose sizes do not shrink is not built)
MAX_PARAMETERS = 2_000_000

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=64, moe_intermediate_size=16, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             shared_expert_intermediate_size=16, n_shared_experts=1, kv_lora_rank=8,
             q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
             first_k_dense_replace=1, n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, rotary_dim=4, chunk_size=8,
             # state-space and linear-attention sizes: their defaults (a 256-token chunk, 128
             # heads of 256 states, 128-wide linear heads) made one hybrid family's forward
             # take more than half of the family test's minute and a half
             mamba_chunk_size=8, mamba_d_state=16, mamba_n_heads=8, mamba_d_ssm=64,
             ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=8,
             linear_key_head_dim=8, linear_value_head_dim=8)
#: tried when the model's own forward fails at SMALL (multi-head latent attention wants as
#: many key/value heads as query heads)
RETRY = dict(num_key_value_heads=4)


def families() -> list[tuple[str, str]]:
    """``(model_type, *ForCausalLM class name)`` of every causal LM transformers maps."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


def _fields(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters)


def tiny_config(model_type: str, **changes: Any) -> Any:
    """``model_type``'s config with small sizes and no dropout."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    names, mapped = _fields(cls), getattr(cls, "attribute_map", {})
    kwargs = {}
    for key, value in {**SMALL, **changes}.items():
        name = key if key in names else mapped.get(key)
        if name in names and value is not None:
            kwargs[name] = value
    for name in names:
        random = ("dropout", "pdrop", "jitter")  # random draws in training
        if any(r in name for r in random) and not name.startswith("use_"):
            default = getattr(cls, name, None)
            if isinstance(default, float):
                kwargs[name] = 0.0
    return cls(**kwargs)


def batch(seed: int, rows: int = 2, length: int = 8) -> dict[str, torch.Tensor]:
    """A padded micro-batch: rows of random lengths, labels -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def packed_batches(seed: int, flash: bool = True) -> list[dict[str, torch.Tensor]]:
    """A packed step's two micro-batches, as Hugging Face's own collator makes them:
    ``DataCollatorWithFlattening``'s row of three documents (``position_ids`` restarting,
    first labels -100, no ``attention_mask``; with ``flash`` its ``cu_seq_lens_q/k`` and
    ``max_length_q/k`` too), and two right-padded rows of several packed documents each
    (position 0 and label -100 on the padding, as TRL's packing collator pads)."""
    from transformers import DataCollatorWithFlattening
    g = torch.Generator().manual_seed(1000 + seed)

    def docs(count: int) -> list[dict[str, list[int]]]:
        sizes = torch.randint(2, 6, (count,), generator=g).tolist()
        return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in sizes]

    row = DataCollatorWithFlattening(return_flash_attn_kwargs=flash)(docs(3))
    rows = [DataCollatorWithFlattening()(docs(k)) for k in (3, 2)]
    width = max(r["input_ids"].shape[1] for r in rows) + 1
    padded = {key: torch.cat([torch.nn.functional.pad(r[key], (0, width - r[key].shape[1]),
                                                      value=-100 if key == "labels" else 0)
                              for r in rows]) for key in ("input_ids", "labels", "position_ids")}
    return [dict(row), padded]


def build(model_type: str, seed: int = 0, **changes: Any) -> tuple[Any, str | None]:
    """``(model, None)``, or ``(None, why)``: the family does not build at small sizes, or its
    own forward fails on a padded batch in training mode (then the pipeline has no oracle).
    ``changes``: config values over the small sizes."""
    model, why = _build(model_type, seed, **changes)
    if model is None and why.startswith("its own forward"):
        retried, _ = _build(model_type, seed, **RETRY, **changes)
        model, why = (retried, None) if retried is not None else (None, why)
    return model, why


def _build(model_type: str, seed: int, **changes: Any) -> tuple[Any, str | None]:
    from transformers import AutoModelForCausalLM
    try:
        config = tiny_config(model_type, **changes)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        count = sum(p.numel() for p in meta.parameters())
        if count > MAX_PARAMETERS:
            return None, f"{count:,} parameters at the small sizes"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - any failure to build is the verdict
        return None, _why(e)
    try:
        model.train()
        model(**{k: v for k, v in batch(0).items() if k != "labels"})
    except Exception as e:  # noqa: BLE001
        return None, f"its own forward fails: {_why(e)}"
    return model, None


def _why(e: Exception) -> str:
    text = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def render(results: dict[str, dict[str, Any]]) -> str:
    """The markdown table of ``results`` (``{model_type: {"class", "verdict", "detail"}}``)."""
    rows = ["| family | class | verdict | packed rows | detail |", "|---|---|---|---|---|"]
    for name in sorted(results):
        r = results[name]
        detail = r.get("detail", "").replace("|", "\\|").replace("\n", " ")
        packed = r.get("packed", "").replace("|", "\\|")
        rows.append(f"| `{name}` | `{r['class']}` | {r['verdict']} | {packed} | {detail} |")
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    summary = ", ".join(f"{counts[k]} {k}" for k in sorted(counts))
    return "\n".join([BEGIN, f"{len(results)} families: {summary}.", "", *rows, END])


def doc_table() -> str:
    """The generated table as docs/hf.md holds it now."""
    text = DOC.read_text()
    return text[text.index(BEGIN):text.index(END) + len(END)]


def write_doc() -> None:
    """Rewrite docs/hf.md's table from the last results file (``python tests/hf_families.py``)."""
    results = json.loads(RESULTS.read_text())
    text = DOC.read_text()
    DOC.write_text(text.replace(doc_table(), render(results)))


if __name__ == "__main__":
    write_doc()
