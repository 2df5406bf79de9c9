------------------------- MODULE MCVllmConnector -------------------------
(* The module TLC runs for VllmConnector: the spec plus the symmetry set. *)
EXTENDS VllmConnector, TLC

\* Keys, requests, ranks and slots are interchangeable (the spec never
\* CHOOSEs among them where it matters; all its models are safety models).
Symmetry == Permutations(Keys) \cup Permutations(Requests)
            \cup Permutations(Ranks) \cup Permutations(Slots)
=============================================================================
