--------------------------- MODULE EmbeddingCache ---------------------------
(***************************************************************************)
(* The entry lifecycle of embcache: one pool of Units allocation units,    *)
(* one entry per key, requests that pin and wait, and transfers in flight  *)
(* that outlive the lock.  The design is DESIGN.md; every action below     *)
(* has the name of the code's action and trace event.  README.md maps each *)
(* action and invariant to the code and to the reference model.            *)
(*                                                                         *)
(* Theory of operation.                                                    *)
(*  - An entry is a record (state, range off..off+size-1, holders, pins,   *)
(*    waiters, doomed, publisher, quarantinePending).  ABSENT is NoEntry.  *)
(*  - The allocator is the set `free` of free units.  It is maintained by  *)
(*    the actions, never derived, so Accounting and NoOverlap can fail.    *)
(*  - The eviction order is a sequence, first victim first: exactly the   *)
(*    evictable entries.  A policy decides where an entry enters it (LRU:  *)
(*    the tail); the spec lets it enter anywhere (see Enter).              *)
(*  - Transfers are explicit: a load writes into a LOADING range, a read   *)
(*    (a holder copying the bytes out) or a publish reads a pinned range.  *)
(*    A transfer that ends with outcome UNKNOWN leaves a zombie that may   *)
(*    still touch its units until the store is fenced.  Each transfer      *)
(*    keeps the units it was started on: if the cache frees or reuses      *)
(*    them early, NoUseAfterFree or QuarantineHolds fails.                 *)
(*  - Requests are slots: a closed slot opens again as a new request, so   *)
(*    behaviours are unbounded while at most |Requests| requests are open  *)
(*    at once.  A request closes only when it holds and waits on nothing.  *)
(*    Who completes a load (a store worker, or the request filling its     *)
(*    reservation) is not modelled: EndLoad is enabled for every LOADING   *)
(*    entry.                                                               *)
(*  - Allocation is a contiguous run at an offset the spec chooses among   *)
(*    the runs the eviction rule allows (see Placements); the victims are  *)
(*    exactly the entries the run overlaps.                                *)
(*  - Admission may refuse any BeginLoad (RefuseBeginLoad): nothing        *)
(*    changes and the item falls back; RefusalChangesNothing checks it.    *)
(*  - Events of the code that change nothing (a Lookup that misses, a      *)
(*    BeginLoad without room, a Remove of a doomed or QUARANTINED entry)   *)
(*    are stuttering steps: Next leaves them out, and LookupIsNoOp,        *)
(*    BeginLoadFails and RemoveIsNoOp say when each is legal.              *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets

CONSTANTS
    Units,            \* pool capacity in allocation units: units 0..Units-1
    Keys,             \* embedding hashes
    Requests,         \* request slots: the most requests open at once
    Sizes,            \* entry sizes (in units) a BeginLoad may ask for
    MaxEvictionBatch, \* the most victims one BeginLoad may evict
    Fences,           \* fence slots: the most fences in flight at once
    NoRequest         \* a model value: "no request"

ASSUME /\ Units \in Nat \ {0}
       /\ Sizes \subseteq 1..Units
       /\ MaxEvictionBatch \in Nat
       /\ NoRequest \notin Requests

ABSENT      == "ABSENT"
LOADING     == "LOADING"
READY       == "READY"
QUARANTINED == "QUARANTINED"
States      == {ABSENT, LOADING, READY, QUARANTINED}

OK       == "OK"
FAILED   == "FAILED"
UNKNOWN  == "UNKNOWN"
Outcomes == {OK, FAILED, UNKNOWN}

VARIABLES
    entry,     \* entry[k]: the entry record of key k (NoEntry when ABSENT)
    free,      \* the allocator's free units
    order,     \* the eviction order: evictable keys, first victim first
    transfers, \* live transfers: [kind, req, key, units]
    zombies,   \* transfers that ended UNKNOWN: [key, units], until their entry is fenced
    request,   \* request[r] \in {"closed", "open"}
    fencing,   \* the fences in flight (begun, not yet ended)
    snapshot   \* snapshot[f]: the keys fence f found QUARANTINED when it began ({} if idle)

vars == <<entry, free, order, transfers, zombies, request, fencing, snapshot>>

Pool == 0..(Units - 1)
Run(o, n) == o..(o + n - 1)

NoEntry == [state |-> ABSENT, off |-> 0, size |-> 0, holders |-> {},
            waiters |-> {}, pins |-> 0, doomed |-> FALSE,
            publisher |-> NoRequest, quarantinePending |-> FALSE, fences |-> {}]

Owned(k) == IF entry[k].state = ABSENT THEN {}
            ELSE Run(entry[k].off, entry[k].size)
UnitsOf(S) == UNION {Owned(k) : k \in S}
Present == {k \in Keys : entry[k].state # ABSENT}
OrderSet == {order[i] : i \in 1..Len(order)}
Quarantine == {k \in Keys : entry[k].state = QUARANTINED}
Without(s, k) == SelectSeq(s, LAMBDA j : j # k)

RECURSIVE SumSizes(_)
SumSizes(S) == IF S = {} THEN 0
               ELSE LET k == CHOOSE x \in S : TRUE
                    IN  entry[k].size + SumSizes(S \ {k})

LoadInto(k, R)  == [kind |-> "load", req |-> NoRequest, key |-> k, units |-> R]
ReadBy(r, k)    == [kind |-> "read", req |-> r, key |-> k, units |-> Owned(k)]
PublishBy(r, k) == [kind |-> "publish", req |-> r, key |-> k, units |-> Owned(k)]
Zombie(k)       == [key |-> k, units |-> Owned(k)]
LoadDone(k) == {t \in transfers : ~(t.kind = "load" /\ t.key = k)}

(***************************************************************************)
(* Eviction that respects contiguity.  A placement of n units at offset o  *)
(* is allowed with the p first entries of the eviction order when the run  *)
(* is made only of free units and of those entries, with at most           *)
(* MaxEvictionBatch victims.                                               *)
(* The victims are exactly the entries the run overlaps, so none is        *)
(* evicted for nothing.  Prefix(n) is the smallest such p (0: a free run   *)
(* fits and nothing is evicted).  The code then picks one placement by     *)
(* fewest victims, fewest bytes, lowest offset and best fit; the spec      *)
(* allows any placement within that prefix (see README: why).              *)
(***************************************************************************)
First(p) == {order[i] : i \in 1..p}
Victims(R) == {j \in Present : Owned(j) \cap R # {}}
Feasible(o, n, p) ==
    LET R == Run(o, n)
        V == Victims(R)
    IN  /\ R \subseteq free \cup UnitsOf(V)
        /\ V \subseteq First(p)
        /\ Cardinality(V) <= MaxEvictionBatch
Placements(n, p) == {o \in 0..(Units - n) : Feasible(o, n, p)}
\* Feasible is monotone in p, so these look at the whole order or at p and p-1.
HasRoom(n) == Placements(n, Len(order)) # {}
Prefix(n) == CHOOSE p \in 0..Len(order) :
                 /\ Placements(n, p) # {}
                 /\ p > 0 => Placements(n, p - 1) = {}

\* Evict(V): the victims leave the table and the order, and give back their units.
EvictEntries(V) == [j \in Keys |-> IF j \in V THEN NoEntry ELSE entry[j]]
EvictUnits(V)   == free \cup UnitsOf(V)
EvictOrder(V)   == SelectSeq(order, LAMBDA j : j \notin V)

\* k becomes evictable and enters the eviction order.  The policy decides
\* where (LRU: at the tail, after the i = Len(order) entries already there);
\* safety must not depend on it, so the spec takes any position i.
Enter(k) == \E i \in 0..Len(order) :
                order' = SubSeq(order, 1, i) \o <<k>> \o SubSeq(order, i + 1, Len(order))

Loading(r, o, n) == [NoEntry EXCEPT !.state = LOADING, !.off = o, !.size = n,
                                    !.waiters = {r}]
Quarantined(e) == [e EXCEPT !.state = QUARANTINED, !.holders = {}, !.waiters = {},
                            !.pins = 0, !.doomed = FALSE,
                            !.quarantinePending = FALSE]

-----------------------------------------------------------------------------
(* Actions. *)

Init ==
    /\ entry = [k \in Keys |-> NoEntry]
    /\ free = Pool
    /\ order = <<>>
    /\ transfers = {}
    /\ zombies = {}
    /\ request = [r \in Requests |-> "closed"]
    /\ fencing = {}
    /\ snapshot = [f \in Fences |-> {}]

OpenRequest(r) ==
    /\ request[r] = "closed"
    /\ request' = [request EXCEPT ![r] = "open"]
    /\ UNCHANGED <<entry, free, order, transfers, zombies, fencing, snapshot>>

CloseRequest(r) ==
    /\ request[r] = "open"
    /\ \A k \in Keys : r \notin entry[k].holders \cup entry[k].waiters
    /\ request' = [request EXCEPT ![r] = "closed"]
    /\ UNCHANGED <<entry, free, order, transfers, zombies, fencing, snapshot>>

Pin(r, k) ==
    /\ entry' = [entry EXCEPT ![k].holders = @ \cup {r}, ![k].pins = @ + 1]
    /\ order' = Without(order, k)
    /\ transfers' = transfers \cup {ReadBy(r, k)}
    /\ UNCHANGED <<free, zombies, request, fencing, snapshot>>

Wait(r, k) ==
    /\ entry' = [entry EXCEPT ![k].waiters = @ \cup {r}]
    /\ UNCHANGED <<free, order, transfers, zombies, request, fencing, snapshot>>

\* A hit pins (READY), a join waits (LOADING).  Every other lookup (a miss,
\* or a repeat) changes nothing: see LookupIsNoOp.
Lookup(r, k) ==
    /\ request[r] = "open"
    /\ r \notin entry[k].holders \cup entry[k].waiters
    /\ ~entry[k].doomed
    /\ entry[k].state \in {READY, LOADING}
    /\ IF entry[k].state = READY THEN Pin(r, k) ELSE Wait(r, k)

\* A store read, a reservation or the copy of a fresh encoder output.  The
\* code emits one Evict event per victim just before this BeginLoad event.
\* Without room it fails and changes nothing: see BeginLoadFails.
BeginLoad(r, k, n) ==
    /\ request[r] = "open"
    /\ entry[k].state = ABSENT
    /\ HasRoom(n)
    /\ \E o \in Placements(n, Prefix(n)) :
         LET R == Run(o, n)
             V == Victims(R)
         IN  /\ entry' = [EvictEntries(V) EXCEPT ![k] = Loading(r, o, n)]
             /\ free' = EvictUnits(V) \ R
             /\ order' = EvictOrder(V)
             /\ transfers' = transfers \cup {LoadInto(k, R)}
             /\ UNCHANGED <<zombies, request, fencing, snapshot>>

\* Admission may refuse any BeginLoad (DESIGN.md, "Eviction order and
\* admission"): a refused BeginLoad allocates nothing, evicts nothing and
\* makes no entry; the item falls back to its encoder output.  It is a
\* stuttering step, but Next names it, so that RefusalChangesNothing (and a
\* mutant that evicts on refusal) has a step to look at.
NotAdmitted(r, k, n) == request[r] = "open" /\ entry[k].state = ABSENT
RefuseBeginLoad(r, k, n) == NotAdmitted(r, k, n) /\ UNCHANGED vars

\* The waiters become holders in the same step: no gap to evict in.  With
\* no waiters the entry is evictable at once.
HandOff(k) ==
    LET e == entry[k] IN
    /\ entry' = [entry EXCEPT ![k] = [e EXCEPT !.state = READY, !.holders = e.waiters,
                                           !.waiters = {}, !.pins = Cardinality(e.waiters)]]
    /\ IF e.waiters = {} THEN Enter(k) ELSE UNCHANGED order
    /\ transfers' = LoadDone(k) \cup {ReadBy(r, k) : r \in e.waiters}
    /\ UNCHANGED free

QuarantineLoad(k) ==
    /\ entry' = [entry EXCEPT ![k] = Quarantined(@)]
    /\ transfers' = LoadDone(k)
    /\ UNCHANGED <<free, order>>

DiscardLoad(k) ==
    /\ entry' = [entry EXCEPT ![k] = NoEntry]
    /\ free' = free \cup Owned(k)
    /\ transfers' = LoadDone(k)
    /\ UNCHANGED order

\* OK & !doomed: READY.  UNKNOWN: QUARANTINED (the write may still land).
\* FAILED, or OK & doomed: freed.  Waiters not handed the entry fall back.
EndLoad(k, outcome) ==
    /\ entry[k].state = LOADING
    /\ zombies' = IF outcome = UNKNOWN THEN zombies \cup {Zombie(k)} ELSE zombies
    /\ IF outcome = OK /\ ~entry[k].doomed THEN HandOff(k)
       ELSE IF outcome = UNKNOWN THEN QuarantineLoad(k)
       ELSE DiscardLoad(k)
    /\ UNCHANGED <<request, fencing, snapshot>>

\* Entry k after one of its pins is dropped (e: the record without that pin).
\* At zero pins a pending quarantine wins over doomed: a zombie publish may
\* still read the range.  Otherwise the entry enters the eviction order.
Unpin(k, e) ==
    IF e.pins > 0 THEN
        entry' = [entry EXCEPT ![k] = e] /\ UNCHANGED <<free, order>>
    ELSE IF e.quarantinePending THEN
        entry' = [entry EXCEPT ![k] = Quarantined(e)] /\ UNCHANGED <<free, order>>
    ELSE IF e.doomed THEN
        entry' = [entry EXCEPT ![k] = NoEntry] /\ free' = free \cup Owned(k) /\ UNCHANGED order
    ELSE
        entry' = [entry EXCEPT ![k] = e] /\ Enter(k) /\ UNCHANGED free

Release(r, k) ==
    /\ r \in entry[k].holders \cup entry[k].waiters
    /\ IF r \in entry[k].waiters
         THEN /\ entry' = [entry EXCEPT ![k].waiters = @ \ {r}]
              /\ UNCHANGED <<free, order, transfers, zombies, request, fencing, snapshot>>
         ELSE /\ Unpin(k, [entry[k] EXCEPT !.holders = @ \ {r}, !.pins = @ - 1])
              /\ transfers' = transfers \ {ReadBy(r, k)}
              /\ UNCHANGED <<zombies, request, fencing, snapshot>>

\* Idle (READY, no pins): freed.  Busy: doomed.  A Remove of a doomed or a
\* QUARANTINED entry (only a Fence frees it) changes nothing: RemoveIsNoOp.
Remove(k) ==
    /\ entry[k].state \in {LOADING, READY}
    /\ ~entry[k].doomed
    /\ IF entry[k].state = READY /\ entry[k].pins = 0
         THEN /\ entry' = [entry EXCEPT ![k] = NoEntry]
              /\ free' = free \cup Owned(k)
              /\ order' = Without(order, k)
              /\ UNCHANGED <<transfers, zombies, request, fencing, snapshot>>
         ELSE /\ entry' = [entry EXCEPT ![k].doomed = TRUE]
              /\ UNCHANGED <<free, order, transfers, zombies, request, fencing, snapshot>>

\* A write of k's range to the global store, under its own pin.
Publish(r, k) ==
    /\ r \in entry[k].holders
    /\ entry[k].publisher = NoRequest
    /\ entry' = [entry EXCEPT ![k].publisher = r, ![k].pins = @ + 1]
    /\ transfers' = transfers \cup {PublishBy(r, k)}
    /\ UNCHANGED <<free, order, zombies, request, fencing, snapshot>>

EndPublish(r, k, outcome) ==
    /\ entry[k].publisher = r
    /\ zombies' = IF outcome = UNKNOWN THEN zombies \cup {Zombie(k)} ELSE zombies
    /\ transfers' = transfers \ {PublishBy(r, k)}
    /\ Unpin(k, [entry[k] EXCEPT !.publisher = NoRequest, !.pins = @ - 1,
                                 !.quarantinePending = @ \/ outcome = UNKNOWN])
    /\ UNCHANGED <<request, fencing, snapshot>>

\* A fence is two steps, with the store's fence between them and no lock
\* held: any number may be in flight at once (a manual fence() while the
\* cache's own one runs, or two manual ones), and meanwhile an entry may be
\* freed by another fence, loaded again, end UNKNOWN and be QUARANTINED again.
\*
\* BeginFence(f): the snapshot, taken just before the store's fence begins: the
\* QUARANTINED entries now.  Each of them is marked with f (entry[k].fences:
\* the spec's identity of an entry, which an entry made later under the same
\* key does not have).
BeginFence(f) ==
    /\ f \notin fencing
    /\ fencing' = fencing \cup {f}
    /\ snapshot' = [snapshot EXCEPT ![f] = Quarantine]
    /\ entry' = [k \in Keys |-> IF k \in Quarantine
                                  THEN [entry[k] EXCEPT !.fences = @ \cup {f}]
                                  ELSE entry[k]]
    /\ UNCHANGED <<free, order, transfers, zombies, request>>

\* The entries of f's snapshot that are still the very entries it took.
Snapshotted(f) == {k \in snapshot[f] : f \in entry[k].fences}

\* Fence(f): the store's fence f returned.  What the store guarantees: the
\* zombies of the entries f snapshotted can no longer land (they are all older
\* than f, since a QUARANTINED entry starts no transfer); every other zombie
\* may (the spec cannot tell whether f stopped it: the conservative choice).
\* What the cache does: free the entries f snapshotted, and only those; not a
\* key of its snapshot that was freed meanwhile and is QUARANTINED again, whose
\* zombie began after f and may still land (mutant fence_frees_by_key).
Fence(f) ==
    /\ f \in fencing
    /\ LET Q == Snapshotted(f) IN
       /\ zombies' = {z \in zombies : z.key \notin Q}
       /\ entry' = [k \in Keys |-> IF k \in Q THEN NoEntry ELSE entry[k]]
       /\ free' = free \cup UnitsOf(Q)
    /\ fencing' = fencing \ {f}
    /\ snapshot' = [snapshot EXCEPT ![f] = {}]
    /\ UNCHANGED <<order, transfers, request>>

\* The cache fences by itself (DESIGN.md, "Fencing") when something is
\* QUARANTINED.  fence() may also be called by hand when nothing is: such a
\* fence snapshots nothing, ends no zombie and frees nothing, so Next leaves
\* it out (it would only occupy a slot); the trace spec takes BeginFence(f)
\* in any state.
BeginFenceStep(f) == Quarantine # {} /\ BeginFence(f)

\* The code's events that change nothing.  They are stuttering steps, so Next
\* leaves them out; the trace spec checks that each was legal.  (A
\* Lookup that misses on a shape or dtype mismatch, which the spec does not
\* model, is a no-op in any state.)
LookupIsNoOp(r, k) ==
    /\ request[r] = "open"
    /\ \/ r \in entry[k].holders \cup entry[k].waiters
       \/ entry[k].doomed
       \/ entry[k].state \in {ABSENT, QUARANTINED}
BeginLoadFails(r, k, n) ==
    /\ request[r] = "open"
    /\ entry[k].state = ABSENT
    /\ ~HasRoom(n)
RemoveIsNoOp(k) == entry[k].state = QUARANTINED \/ entry[k].doomed

\* EndPublish(r, k, FAILED) is the very same step as EndPublish(r, k, OK) (both
\* only drop the publish pin), so Next names only OK, which spares TLC an
\* eighth of its work; the trace spec takes either.
Next ==
    \/ \E r \in Requests : OpenRequest(r) \/ CloseRequest(r)
    \/ \E r \in Requests, k \in Keys : Lookup(r, k) \/ Release(r, k) \/ Publish(r, k)
    \/ \E r \in Requests, k \in Keys, n \in Sizes :
           BeginLoad(r, k, n) \/ RefuseBeginLoad(r, k, n)
    \/ \E k \in Keys, o \in Outcomes : EndLoad(k, o)
    \/ \E r \in Requests, k \in Keys, o \in {OK, UNKNOWN} : EndPublish(r, k, o)
    \/ \E k \in Keys : Remove(k)
    \/ \E f \in Fences : BeginFenceStep(f) \/ Fence(f)

\* Per key: loads and publishes complete, a pinned entry is released by some
\* holder.  The cache fences by itself: while something is QUARANTINED, a
\* fence eventually begins (its snapshot holds every QUARANTINED entry), and
\* every fence in flight ends.  A waiter does not give up on its own (EndLoad
\* serves it), and closes need no fairness: NoLeak assumes that requests
\* stop.  The fewer the fairness conditions, the stronger the properties, and
\* the faster TLC checks them.  (Before fences had two steps the fence
\* fairness was per key, WF_vars(FenceOf(k)): a one-step fence of any subset
\* of the quarantine could starve one entry; a snapshot is now all of it.)
Fairness ==
    /\ \A k \in Keys :
        /\ WF_vars(\E o \in Outcomes : EndLoad(k, o))
        /\ WF_vars(\E r \in Requests, o \in Outcomes : EndPublish(r, k, o))
        /\ WF_vars(\E r \in entry[k].holders : Release(r, k))
    /\ WF_vars(\E f \in Fences : BeginFenceStep(f))
    /\ \A f \in Fences : WF_vars(Fence(f))

Spec == Init /\ [][Next]_vars
LiveSpec == Spec /\ Fairness

-----------------------------------------------------------------------------
(* Invariants: the list of DESIGN.md, in its order, after TypeOK. *)

Transfer == [kind : {"load", "read", "publish"}, req : Requests \cup {NoRequest},
             key : Keys, units : SUBSET Pool]
Entry == [state : States, off : 0..Units, size : 0..Units,
          holders : SUBSET Requests, waiters : SUBSET Requests,
          pins : 0..(Cardinality(Requests) + 1), doomed : BOOLEAN,
          publisher : Requests \cup {NoRequest}, quarantinePending : BOOLEAN,
          fences : SUBSET Fences]

TypeOK ==
    /\ entry \in [Keys -> Entry]
    /\ \A k \in Keys : entry[k].state = ABSENT => entry[k] = NoEntry
    /\ free \subseteq Pool
    /\ order \in Seq(Keys)
    /\ transfers \subseteq Transfer
    /\ zombies \subseteq [key : Keys, units : SUBSET Pool]
    /\ request \in [Requests -> {"closed", "open"}]
    /\ fencing \subseteq Fences
    /\ snapshot \in [Fences -> SUBSET Keys]

\* Allocated ranges are disjoint and inside the pool.
NoOverlap ==
    /\ \A k \in Present : entry[k].size > 0 /\ Owned(k) \subseteq Pool
    /\ \A j, k \in Present : j # k => Owned(j) \cap Owned(k) = {}

\* Allocated units = sizes of present entries = capacity - free.  The free
\* set is a set of units, so "fully coalesced" holds trivially here.
Accounting ==
    /\ Units - Cardinality(free) = SumSizes(Present)
    /\ free \cap UnitsOf(Present) = {}

\* pins = holders + the publish in flight; pins only on READY entries,
\* waiters only on LOADING ones; holders and waiters are open requests.
PinsExact ==
    \A k \in Keys :
        /\ entry[k].pins = Cardinality(entry[k].holders)
                           + (IF entry[k].publisher # NoRequest THEN 1 ELSE 0)
        /\ entry[k].pins > 0 => entry[k].state = READY
        /\ entry[k].waiters # {} => entry[k].state = LOADING
        /\ entry[k].holders \cap entry[k].waiters = {}
        /\ \A r \in entry[k].holders \cup entry[k].waiters : request[r] = "open"

\* A live transfer touches only units its own entry owns: a load a LOADING
\* entry, a read or publish a READY entry pinned by that reader or publish.
NoUseAfterFree ==
    \A t \in transfers :
        /\ t.units \cap free = {}
        /\ t.units \subseteq Owned(t.key)
        /\ t.kind = "load" => entry[t.key].state = LOADING
        /\ t.kind = "read" => entry[t.key].state = READY /\ t.req \in entry[t.key].holders
        /\ t.kind = "publish" => entry[t.key].state = READY /\ entry[t.key].publisher = t.req

\* The eviction order holds each evictable entry once, and nothing else.
EvictableExact ==
    /\ Len(order) = Cardinality(OrderSet)
    /\ OrderSet = {k \in Keys : /\ entry[k].state = READY /\ entry[k].pins = 0
                              /\ ~entry[k].doomed /\ ~entry[k].quarantinePending}

DoomedIsBusy ==
    \A k \in Keys : entry[k].doomed =>
        \/ entry[k].state = LOADING
        \/ entry[k].state = READY /\ entry[k].pins > 0

\* A zombie's units stay allocated to its QUARANTINED (or quarantine-pending)
\* entry until a Fence: neither free nor reused.
QuarantineHolds ==
    /\ \A z \in zombies :
        /\ z.units \cap free = {}
        /\ z.units \subseteq Owned(z.key)
        /\ \/ entry[z.key].state = QUARANTINED
           \/ entry[z.key].state = READY /\ entry[z.key].quarantinePending
    /\ \A k \in Keys : entry[k].quarantinePending =>
                           entry[k].state = READY /\ entry[k].pins > 0
    /\ \A k \in Keys : entry[k].state = QUARANTINED =>
                           /\ entry[k].pins = 0 /\ entry[k].waiters = {}
                           /\ ~entry[k].doomed /\ entry[k].publisher = NoRequest
    /\ \A k \in Keys : \A f \in entry[k].fences :
           /\ entry[k].state = QUARANTINED
           /\ f \in fencing /\ k \in snapshot[f]

\* Eviction that respects contiguity, as a property of steps: a step that
\* starts a load frees only READY entries its new range overlaps (none is
\* evicted for nothing), and none at all when a free run already fitted.
NoWastedEviction ==
    [][\A k \in Keys :
         entry[k].state = ABSENT /\ entry'[k].state = LOADING =>
             LET n == entry'[k].size
                 V == {j \in Keys : entry[j].state = READY /\ entry'[j].state = ABSENT}
             IN  /\ \A j \in V : Owned(j) \cap Run(entry'[k].off, n) # {}
                 /\ V # {} => \A o \in 0..(Units - n) : ~(Run(o, n) \subseteq free)]_vars

\* Admission: a refused BeginLoad changes nothing (no eviction, no
\* allocation, no entry, no transfer); the item falls back.
RefusalChangesNothing ==
    [][\A r \in Requests, k \in Keys, n \in Sizes :
           RefuseBeginLoad(r, k, n) => UNCHANGED <<entry, free, order, transfers>>]_vars

\* Overlapping fences: a QUARANTINED entry is freed only by the end of a fence
\* whose snapshot holds that very entry (its key, and the entry itself: not an
\* entry quarantined again under the same key after the fence began).
FenceFreesSnapshot ==
    [][\A k \in Keys :
         entry[k].state = QUARANTINED /\ entry'[k].state = ABSENT =>
             \E f \in fencing \ fencing' : k \in snapshot[f] /\ f \in entry[k].fences]_vars

-----------------------------------------------------------------------------
(* Liveness, checked under LiveSpec (never with symmetry). *)

NoneOpen == \A r \in Requests : request[r] # "open"

Quiescent ==
    /\ \A k \in Keys : /\ entry[k].state \in {ABSENT, READY}
                       /\ entry[k].pins = 0 /\ ~entry[k].doomed
    /\ transfers = {} /\ zombies = {}
    /\ Units - Cardinality(free) = SumSizes(Present)

\* Once requests stop, every pin, load, doom and quarantine drains away.
NoLeak == <>[]NoneOpen => <>[]Quiescent

\* A removed entry is eventually freed, even while requests keep coming: it
\* takes no new pins, so its holders, load and publish all end.
DoomedFreed == \A k \in Keys : entry[k].doomed ~> entry[k].state = ABSENT

\* Every waiter is eventually a holder of the READY entry or has fallen back:
\* every set of waiters empties (which implies that each waiter r leaves it,
\* and costs TLC one leads-to per key instead of one per request and key).
WaiterServed == \A k \in Keys : entry[k].waiters # {} ~> entry[k].waiters = {}

=============================================================================
