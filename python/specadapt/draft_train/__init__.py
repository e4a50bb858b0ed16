"""Training the EAGLE-style draft head offline (issue 15): the prompt split (:mod:`.split`), the target's own
generations with the features the head reads, in resumable shards (:mod:`.data`), the draft vocabulary
(:mod:`.vocab`) and the EAGLE-3 unrolled training objective (:mod:`.unroll`). ``scripts/gen_draft_data.py``
and ``scripts/train_draft.py`` are the command lines.

An adapter-level package: it drives the embedded engine's native forward and transformers' EAGLE head.
"""
