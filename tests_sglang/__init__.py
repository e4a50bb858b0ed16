"""The SGLang plugin's tests against the real sglang (``make test-sglang``). A package, so its modules and the
shared helpers are imported by qualified name (``tests_sglang.helpers``, ``tests.helpers.sglang``)."""
