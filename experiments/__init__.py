"""Applications of the library and the agent: hydra apps ``train`` and ``compare`` (``conf/``), the result
tables' scripts (``tables``, ``transfer``, ``zero_shot``), the release tool ``ship``, user-style ``models/``."""
