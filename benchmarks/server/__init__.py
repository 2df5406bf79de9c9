"""An encode server end to end (``bench_server``) and its parts."""
