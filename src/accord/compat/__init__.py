"""accord's reach-ins to other libraries' private API, one module per library.

What belongs here: every use of something another library does not promise to keep (an
underscored attribute or module, a class method swapped for a while, a private state-dict
key, a C library function called through ctypes). Where a public API does the same with
the same numbers, accord uses that instead and it does not belong here.

The rule: code elsewhere in accord calls only the small named functions of these modules,
never the private thing itself. Each module says which versions it was written against
(WRITTEN_FOR) and, where the private thing has gone, fails with one line naming the
library, its installed version and what accord needed (IncompatibleLibrary), instead of an
AttributeError deep in a run. tests/test_compat.py holds one cheap canary per reach-in, so
an upgrade that breaks one fails there first.

The modules: deepspeed (ZeRO internals, the ZeRO-3 fp32-partition method swap, the Ulysses
attention's set-up), torch, transformers, gguf, datasets, and libc, whose calls are optional
levers: where the C library lacks one, it says so and accord runs without it.

Each module imports its library lazily (inside the functions), so `import accord` and a
worker's start import nothing more than before.
"""

from __future__ import annotations

from accord.errors import RunStopped


class IncompatibleLibrary(RunStopped):
    """An installed library lacks (or changed) a private API accord relies on."""


def installed_version(distribution: str) -> str:
    """The installed version of `distribution` (its package metadata; nothing imported)."""
    from importlib import metadata  # only when an error is made: `import accord` does not pay for it

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def incompatible(
    library: str, version: str, missing: str, needed_by: str, written_for: str, remedy: str = ""
) -> IncompatibleLibrary:
    """The one-line error for a private API that is gone: `missing` names it, `needed_by` says
    which part of accord uses it."""
    return IncompatibleLibrary(
        f"{library} {version}: {missing}, which {needed_by} needs (written for {library} {written_for}); "
        f"install such a {library}{f' or {remedy}' if remedy else ''}"
    )
