"""specadapt: long-generation speculative decoding.

Layers (imports point down only, see docs/design/DESIGN.md): ``cli`` -> ``engine`` (embedded, transformers) ->
techniques (``verification``, ``sampling``) -> ``kernels`` (``specadapt._C`` plus float64 references).
Importing ``specadapt`` does not import transformers or sglang.
"""

__version__ = "0.1.0"
