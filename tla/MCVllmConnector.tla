------------------------- MODULE MCVllmConnector -------------------------
(* The module TLC runs for VllmConnector: the spec plus the symmetry sets. *)
EXTENDS VllmConnector, TLC

\* Keys, requests and pool slots are interchangeable (the spec never
\* CHOOSEs among them; all its models are safety models), and so are the
\* ranks in a model without the producer path (Producer = FALSE: no saves,
\* so Rank0 does nothing the others do not).  With it, Rank0 writes them.
Symmetry == Permutations(Keys) \cup Permutations(Requests) \cup Permutations(Slots)
            \cup Permutations(Ranks)
SymmetryRank0 == Permutations(Keys) \cup Permutations(Requests) \cup Permutations(Slots)
=============================================================================
