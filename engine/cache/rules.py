"""ClassLRU's numbers and admission rules, shared by its interface (policy) and its compiled core (lru_core).

Kept apart and free of numba, so that the UI process can name the policies without compiling anything.
"""

from __future__ import annotations

N_CLASS = 8
CRF_HALF_LIFE = 128.0  # tokens of the layer's clock
N_DECAY = 8192  # the decay 2^(-dt/128) comes from a table below this age
SECOND_USE_WINDOW = 256  # tokens of the layer's clock
UPLOAD_CAP = 1  # uploads per token of a lookup, once the group is full
PROTECT_RATIO = 1.0  # "protect" admits a miss whose CRF is at least this times its victim's

# Admission rules (`--moe-cache-policy`), by name: the codes the compiled core branches on.
CLASSLRU, SECOND_USE, UPLOAD_CAP_RULE, PROTECT = 0, 1, 2, 3
ADMISSIONS: dict[str, int] = {"classlru": CLASSLRU, "second-use": SECOND_USE, "upload-cap": UPLOAD_CAP_RULE,
                              "protect": PROTECT}  # fmt: skip
POLICIES = tuple(ADMISSIONS)
SHARE_ONE = 1 << 16  # the CPU share is kept in 1/65536
LOGGED = 1 << 32  # in a compiled lookup's result: the lookup went into the lookup log
SMALL_BATCH = 8  # the counters split batches at 8 tokens, like the seed
