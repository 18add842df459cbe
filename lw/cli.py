"""The `lw` command line: one entry point, subcommands loaded on demand."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help); each module has main(argv) -> int
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("lw.lab.demo", "run a local P/D cluster and report (default: real vLLM engines)"),
    "hostile": ("lw.lab.hostile", "send hostile inputs to a local P/D cluster (real "
                "vLLM engines) and print what each did"),
    "check": ("lw.sim.cli", "model-check the protocol (exhaustive or random)"),
    "config": ("lw.vllm_adapter.config_explain", "--explain: each connector setting of a "
               "--kv-transfer-config file, its value and source; exit 2 on refused keys"),
    "diagrams": ("lw.diagrams", "regenerate or --check docs/diagrams"),
    "proxy": ("lw.proxy.server", "run the D-first proxy in front of vLLM servers"),
    "status": ("lw.ops.cli", "live requests of running P and D workers, timelines, traces"),
    "validate": ("lw.sim.validate_cli", "is a recorded run (lw-trace file) a behaviour of the "
                 "checked model?"),
}


def usage() -> str:
    """Help text listing the subcommands."""
    lines = ["usage: lw <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``lw <command> ...`` to the command's module."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    cmd, rest = args[0], args[1:]
    if cmd not in COMMANDS:
        print(f"lw: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)
