--------------------------- MODULE MCFleetClaims ---------------------------
(* The module TLC runs for FleetClaims: the spec plus the symmetry set. *)
EXTENDS FleetClaims, TLC

\* Workers and keys are interchangeable (the spec never CHOOSEs among them).
\* Safety models only: symmetry is unsound for liveness.
Symmetry == Permutations(Workers) \cup Permutations(Keys)
=============================================================================
