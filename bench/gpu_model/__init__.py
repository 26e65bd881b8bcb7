"""The GPU without a GPU: the static performance model (:mod:`.model`), Triton compilation and
SASS reading (:mod:`.compiler`), the kernels' launch descriptions (:mod:`.launches`), the shape
table and its command (:mod:`.static`), validation against published timings
(:mod:`.peer_validation`), the on-paper end-to-end figure (:mod:`.e2e`), the predictions beside
a measured ``bench gpu`` record (:mod:`.predict`), and the dry run of every CUDA code path on a
fake CUDA device (:mod:`.fake_cuda`, :mod:`.dry_run`)."""
