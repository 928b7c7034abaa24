"""The C extensions are optional (pyproject.toml lists them): an install without a C compiler, or
without xxHash's header for the native tree core, still succeeds and runs the reference core. Each
extension left out says why in one line."""

from __future__ import annotations

import os
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_ext import build_ext

NEEDS_XXHASH = {"tpcache.core.treecore._node", "tpcache.io._record"}
XXHASH_HELP = (
    "xxhash.h not found: install libxxhash-dev (make setup does), or download xxhash.h from "
    "https://github.com/Cyan4973/xxHash/releases and set C_INCLUDE_PATH to its directory"
)


INSTEAD = {
    "tpcache.core.treecore._node": "the reference tree core runs instead",
    "tpcache.io._rowcopy": "page copies use torch instead",
    "tpcache.io._record": "the shard layout checks its records in Python instead",
    "protocol._speedups": "the codec checks ids in Python instead",
}


def warn(name: str, why: str) -> None:
    print(f"tpcache: building without {name} ({why}); {INSTEAD.get(name, 'Python runs instead')}", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext that leaves an extension out, in one line, where it cannot be built."""

    def compiles(self, include: str = "") -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            source = os.path.join(tmp, "probe.c")
            with open(source, "w") as f:
                f.write((f"#include <{include}>\n" if include else "") + "int main(void) { return 0; }\n")
            saved = os.dup(2)  # the probe's compiler errors are not the user's: the warning says why
            try:
                with open(os.devnull, "w") as null:
                    os.dup2(null.fileno(), 2)
                    self.compiler.compile([source], output_dir=tmp, include_dirs=self.include_dirs)
            except Exception:
                return False
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        return True

    def build_extensions(self) -> None:
        if not self.compiles():
            for ext in list(self.extensions):
                warn(ext.name, f"no working C compiler ({self.compiler.compiler_type})")
                self.extensions.remove(ext)
            return
        if any(ext.name in NEEDS_XXHASH for ext in self.extensions) and not self.compiles("xxhash.h"):
            for ext in [e for e in self.extensions if e.name in NEEDS_XXHASH]:
                warn(ext.name, XXHASH_HELP)
                self.extensions.remove(ext)
        super().build_extensions()

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # no compiler, or a compile error: the extension is optional
            if not getattr(ext, "optional", False):
                raise
            warn(ext.name, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'failed'}")


setup(cmdclass={"build_ext": OptionalBuildExt})
