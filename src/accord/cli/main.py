"""The `accord` command: parse, call, and show user mistakes as one line each."""

from __future__ import annotations

import sys

from accord.cli.errors import fail
from accord.cli.parser import RECIPE_COMMANDS, build_parser
from accord.errors import AccordError
from accord.launch import ending


def launcher_arguments(argv: list[str]) -> list[str]:
    """argv without what launchers put into a script's arguments, wherever they put it:
    `--local_rank=N` / `--local-rank=N` (torch.distributed.launch, DeepSpeed's launcher; the
    rank is read from the environment they also set) and `--deepspeed FILE` (DeepSpeed's
    convention, read as engine.deepspeed_config=FILE)."""
    out: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        i += 1
        name, eq, value = item.partition("=")
        if name in ("--local_rank", "--local-rank"):
            if not eq and i < len(argv) and argv[i].isdigit():
                i += 1
        elif name in ("--deepspeed", "--deepspeed_config", "--deepspeed-config"):
            if not eq and i < len(argv):
                value, i = argv[i], i + 1
            if not value:
                raise SystemExit(fail(f"{name} needs a DeepSpeed JSON file"))
            overrides.append(f"engine.deepspeed_config={value}")
        else:
            out.append(item)
    return out + overrides


def entry() -> None:
    """The `accord` command (and `python -m accord`)."""
    code = main()
    if ending.skips_teardown():  # it trained here, or its workers did (launch/ending.py)
        ending.exit_now(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = launcher_arguments(sys.argv[1:] if argv is None else list(argv))
    tail: list[str] = []
    if argv[:1] == ["import"] and "--" in argv:  # `accord import [options] -- trl sft ...`: the job's own command
        tail, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    parser = build_parser()
    # Overrides may come before or after options; argparse collects the ones it meets
    # after an option as unknown arguments.
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown or (extra and args.command not in RECIPE_COMMANDS):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if args.command == "import":
        args.command_line = tail
    if args.command in RECIPE_COMMANDS:
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except AccordError as e:
        return fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        return fail("interrupted", code=130)


if __name__ == "__main__":
    sys.exit(main())
