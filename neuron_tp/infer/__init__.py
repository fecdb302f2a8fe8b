"""Generation and serving: ``neuron-tp generate`` (:mod:`.batch`, a :class:`~.generate.Generator`
over bucketed static shapes) and ``neuron-tp serve`` (:mod:`.server`, an OpenAI-compatible HTTP
API over the continuous-batching :class:`~.engine.Engine` and the decode slots of
:mod:`.slots`); graphs captured once and replayed (:mod:`.replay`)."""
