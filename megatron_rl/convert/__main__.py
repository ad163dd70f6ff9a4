"""The torchrun entry point of the conversion workers: `python -m megatron_rl.convert JOB_JSON`.

Kept light on purpose (no torch at import): megatron's checkpoint saver spawns a helper process
that re-imports the `__main__` module.
"""

import sys

if __name__ == "__main__":
    from ..megatron import cpu_compat

    cpu_compat.apply()   # before the worker imports megatron-core
    from ..console import quiet_third_party

    quiet_third_party()
    from .worker import main

    sys.exit(main(sys.argv[1:]))
