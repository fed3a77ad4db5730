"""One engine step: the engine contract (`Engine`, `StepInputs`, `StepOutput`,
`PackedStep`), buckets and their ladders (`bucket_fit`), and the one builder of the
padded step descriptor (`packing.pack_step`).

May import: numpy and the standard library only.
"""
