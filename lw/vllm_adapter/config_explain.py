"""``lw config --explain``: what lw's connector would run with, given a ``--kv-transfer-config``
file, before an engine starts.

Prints every setting's effective value and its source (default, file, environment, derived)
by section; exits 2 naming each unknown key and each contradiction :meth:`LwConfig.build`
refuses (a refused key is left out and the rest checked again, so one run names them all).
Checks that need the model's KV heads run only with ``--model``; the others that need a
running engine are listed as not checked. The cluster key is never printed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from lw.fsm.kvmap import tp_problem
from lw.vllm_adapter.config import (
    CONSUMER,
    DERIVED,
    EXPERIMENTAL,
    PRODUCER,
    SECTIONS,
    ConfigError,
    LwConfig,
    ModelHeads,
    fields_of,
    key_problems,
)

__all__ = ["explain", "heads_from_model", "lw_part", "main"]

ROLES = {"prefill": PRODUCER, "decode": CONSUMER}
SIDES = {PRODUCER: "P", CONSUMER: "D"}
_ROLE_NAME = {PRODUCER: "prefill", CONSUMER: "decode"}
VLLM_KV_PORT = 14579
"""vLLM's default ``kv_port`` (KVTransferConfig), used when the file names none."""


class ExplainError(Exception):
    """A file or model ``lw config`` cannot read; the message says which and why."""


def lw_part(doc: Any) -> dict[str, Any]:
    """lw's own kv_transfer_config in ``doc``: the object itself, or the LwConnector inside a
    MultiConnector's ``connectors`` (its engine id and role from the outer object)."""
    if not isinstance(doc, dict) or not ({"kv_connector", "kv_role",
                                          "kv_connector_extra_config"} & doc.keys()):
        raise ExplainError("not a --kv-transfer-config: expected a JSON object with "
                           "kv_connector, kv_role and kv_connector_extra_config")
    if doc.get("kv_connector") == "MultiConnector":
        inner = (doc.get("kv_connector_extra_config") or {}).get("connectors") or []
        mine = [c for c in inner if isinstance(c, dict) and c.get("kv_connector") == "LwConnector"]
        if len(mine) != 1:
            raise ExplainError(f"a MultiConnector with {len(mine)} LwConnector(s) among its "
                               "connectors; expected one")
        return {**{k: doc[k] for k in ("kv_role", "engine_id") if k in doc}, **mine[0]}
    if doc.get("kv_connector", "LwConnector") != "LwConnector":
        raise ExplainError(f"kv_connector is {doc['kv_connector']!r}, not 'LwConnector' (or a "
                           "MultiConnector holding it)")
    return doc


def heads_from_model(model: str) -> ModelHeads:
    """The KV heads of ``model`` (a directory or its config.json; else a name in the local
    Hugging Face cache), counted from its config as vLLM does for common models."""
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    try:
        if file.is_file():
            cfg = json.loads(file.read_text())
        else:
            from transformers import AutoConfig  # local files only: lw fetches nothing

            cfg = AutoConfig.from_pretrained(model, local_files_only=True).to_dict()
    except Exception as exc:  # noqa: BLE001 - any failure to read it is reported as such
        raise ExplainError(f"--model {model}: cannot read its config ({exc})") from None
    text = (cfg.get("text_config") or cfg) if isinstance(cfg, dict) else {}
    if text.get("kv_lora_rank"):
        return ModelHeads(1, True)  # MLA: one latent vector per token
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ExplainError(f"--model {model}: its config names no KV heads "
                           "(num_key_value_heads, num_attention_heads)")
    return ModelHeads(heads, False)


def _without(extra: dict[str, Any], message: str) -> tuple[dict[str, Any], bool]:
    """``extra`` less every key (top level or in ``experimental``) that ``message`` names;
    False when it names none (nothing left to leave out)."""
    def named(key: str) -> bool:
        return re.search(rf"(?<!\w){re.escape(key)}(?!\w)", message) is not None

    top = {k: v for k, v in extra.items() if k == EXPERIMENTAL or not named(k)}
    inner = top.get(EXPERIMENTAL)
    if isinstance(inner, dict):
        top[EXPERIMENTAL] = {k: v for k, v in inner.items() if not named(k)}
    return top, top != extra


def _problems_of_keys(extra: Any) -> tuple[list[str], dict[str, Any]]:
    """Every key refused by name (unknown, moved, derived) and ``extra`` without them."""
    problems = key_problems(extra)
    if not isinstance(extra, dict):
        return problems, {}
    inner = extra.get(EXPERIMENTAL)
    top, valid_in = LwConfig.extra_keys(), LwConfig.experimental_keys()
    kept = {k: v for k, v in extra.items() if k in top and k != EXPERIMENTAL}
    if isinstance(inner, dict):
        kept[EXPERIMENTAL] = {k: v for k, v in inner.items() if k in valid_in}
    return problems, kept


def _show(value: Any) -> str:
    """A value as the file would write it."""
    return format(value, "g") if isinstance(value, float) else json.dumps(value)


def _rows(cfg: LwConfig, sources: dict[str, str]) -> list[str]:
    """The settings' lines, by section: name, effective value, source, and a note."""
    side = SIDES[cfg.role]
    out = []
    for section in (*SECTIONS, EXPERIMENTAL, DERIVED):
        out.append(f"{section}" + (" (unsupported)" if section == EXPERIMENTAL else ""))
        for f in fields_of(section):
            name = f"{EXPERIMENTAL}.{f.name}" if section == EXPERIMENTAL else f.name
            value = getattr(cfg, f.name)
            note = ""
            shown = "(not shown)" if f.metadata.get("secret") and value else _show(value)
            if f.metadata.get("secret") and not value:
                note = "unset: side channel and metaserver calls unauthenticated"
            elif f.name == "bind_host" and not value:
                note = f"= host, {cfg.host}"
            elif f.name == "peer_tp_size" and not value:
                note = f"= own TP, {cfg.tp_size}"
            if f.metadata.get("side") not in (None, "both", side):
                note = ", ".join(filter(None, (note, f"not read by a {_ROLE_NAME[cfg.role]} "
                                                     "engine")))
            line = f"  {name:<38} {shown:<18} {sources[f.name]}"
            out.append(line + (f" ({note})" if note else ""))
    return out


def explain(doc: Any, role: str, tp: int, heads: ModelHeads | None, out: TextIO,
            err: TextIO, model: str = "") -> int:
    """Explain lw's part of the kv_transfer_config ``doc`` for a ``role`` engine of TP ``tp``
    (the model's ``heads`` when known): the report on ``out``, each refusal on ``err``;
    returns the exit code (0, or 2 when anything is refused)."""
    part = lw_part(doc)
    problems: list[str] = []
    given_role = part.get("kv_role")
    if given_role is not None and given_role != role:
        problems.append(f"kv_role is {given_role!r} in the file, but --role says "
                        f"{_ROLE_NAME.get(role)} ({role!r})")
    kv_port = part.get("kv_port", VLLM_KV_PORT)
    policy = part.get("kv_load_failure_policy", "fail")
    if not isinstance(kv_port, int) or isinstance(kv_port, bool):
        problems.append(f"kv_port must be an integer, got {kv_port!r}")
        kv_port = VLLM_KV_PORT
    key_refusals, extra = _problems_of_keys(part.get("kv_connector_extra_config") or {})
    problems += key_refusals
    built: tuple[LwConfig, dict[str, str]] | None = None
    for _ in range(len(LwConfig.extra_keys()) + len(LwConfig.experimental_keys()) + 1):
        try:
            built = LwConfig.explained(role=role, engine_id=str(part.get("engine_id", "explain")),
                                       kv_port=kv_port, tp_size=tp, pp_size=1, dp_size=1,
                                       dp_rank=0, load_failure_policy=policy, extra=extra,
                                       heads=heads)
            break
        except ConfigError as exc:
            problems.append(str(exc))
            extra, left_out = _without(extra, str(exc))
            if not left_out:
                break
    side = _ROLE_NAME[role]
    print(f"lw config --explain: {side} engine ({role}), TP {tp}, kv_port {kv_port}"
          f"{'' if 'kv_port' in part else ' (vLLM default)'}, kv_load_failure_policy "
          f"{policy}", file=out)
    if built is not None:
        if problems:
            print("(values as if the refused keys were not given)", file=out)
        print("\n".join(_rows(*built)), file=out)
    print("checks that need the model:", file=out)
    peer = built[0].peer_tp_size if built is not None else 0
    if heads is None:
        print(f"  not checked: TP {tp}{' and peer_tp_size ' + str(peer) if peer else ''} "
              "against the model's KV heads (give --model)", file=out)
    else:
        kind = "MLA, one latent vector" if heads.mla else f"{heads.total} KV heads"
        why = tp_problem(tp, heads.total, heads.mla)
        if why:
            problems.append(f"--tp {tp}: this engine cannot shard the model's KV ({why})")
        print(f"  checked with --model {model} ({kind}): this engine's TP {tp}"
              f"{', peer_tp_size ' + str(peer) if peer else ''}", file=out)
    print("  not checked: one KV cache group (hybrid models are refused) and the KV layout; "
          "the engine checks them when it starts", file=out)
    for p in problems:
        print(f"error: {p}", file=err)
    print(f"{len(problems)} problem(s)" if problems else "ok", file=out)
    return 2 if problems else 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``lw config``'s arguments (argparse exits 2 on bad ones)."""
    ap = argparse.ArgumentParser(
        prog="lw config", description="Explain lw's connector settings of a "
        "--kv-transfer-config file: each value and its source; exit 2 on refused keys.")
    ap.add_argument("--explain", action="store_true", required=True,
                    help="print each setting's effective value and source")
    ap.add_argument("--role", choices=tuple(ROLES), required=True,
                    help="the engine the file is for")
    ap.add_argument("--tp", type=int, default=1, help="the engine's tensor_parallel_size")
    ap.add_argument("--model", default="", help="model directory (or its config.json, or a "
                    "name in the local Hugging Face cache): check TP sizes against its KV heads")
    ap.add_argument("file", help="the --kv-transfer-config JSON (vLLM's object, "
                    "kv_connector_extra_config inside)")
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error(f"--tp must be >= 1, got {args.tp}")
    return args


def main(argv: list[str] | None = None) -> int:
    """``lw config --explain --role prefill|decode [--tp N] [--model M] FILE``."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        try:
            doc = json.loads(Path(args.file).read_text())
        except (OSError, ValueError) as exc:
            raise ExplainError(f"{args.file}: {exc}") from None
        heads = heads_from_model(args.model) if args.model else None
        return explain(doc, ROLES[args.role], args.tp, heads, sys.stdout, sys.stderr,
                       model=args.model)
    except ExplainError as exc:
        print(f"lw config: {exc}", file=sys.stderr)
        return 2
