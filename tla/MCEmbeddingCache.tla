-------------------------- MODULE MCEmbeddingCache --------------------------
(* The module TLC checks: the spec plus what the .cfg files of models/ need. *)
EXTENDS EmbeddingCache, TLC

\* Keys and requests are interchangeable (the spec never CHOOSEs among them).
\* Safety models only: symmetry is unsound for liveness.
Symmetry == Permutations(Keys) \cup Permutations(Requests) \cup Permutations(Fences)
=============================================================================
