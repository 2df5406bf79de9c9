------------------------ MODULE TraceEmbeddingCache -------------------------
(***************************************************************************)
(* Trace validation: a run of the real cache, recorded by its              *)
(* trace= hook, is accepted iff it is a behaviour of EmbeddingCache.       *)
(*                                                                         *)
(* Traces is a sequence of traces; TLC picks one (t) in the initial state  *)
(* and then follows it event by event (i: the index of the next event).   *)
(* A trace is a sequence of indices into Events, the distinct event       *)
(* records (many events repeat: TLC parses a short module much faster).   *)
(* Each step takes exactly the spec action the event names, with the       *)
(* event's parameters, and then checks the entry's post-state that the    *)
(* code logged (state, range, holders, waiters, publish pin, doomed,       *)
(* quarantinePending) against the spec's.  The spec's invariants are       *)
(* checked in every state by the model (see tla/trace.py).  A trace that   *)
(* the spec cannot follow deadlocks at the first event it cannot explain:  *)
(* i then names that event.                                                *)
(*                                                                         *)
(* tla/trace.py converts a JSON-lines trace into events, records with the  *)
(* same fields for every event (the code's seq stays with tla/trace.py):   *)
(*   a    the action name (the code's and the spec's)                      *)
(*   r    the request slot (for EndPublish: the slot that published)       *)
(*   k    the key ("" for none)                                            *)
(*   n, o the size and offset in units (bytes / alignment)                 *)
(*   out  the outcome ("" for none)                                        *)
(*   e    whether the event carries the entry's post-state, then:          *)
(*   st, h, w, p, d, q   state, holders, waiters, publisher slot, doomed,  *)
(*        tainted (the spec's quarantinePending)                           *)
(*   V    BeginLoad: the keys evicted for it (its preceding Evict events)  *)
(*   at   where the key enters the eviction order, if it does: -1 at    *)
(*        the tail (LRU, and any policy that logs no position), else the   *)
(*        number of entries ahead of it (the event's position)             *)
(*   f    BeginFence, Fence: the fence slot (the code's fence id, mapped)  *)
(*   Q    BeginFence: the keys of its snapshot; Fence: the keys it freed   *)
(*   x    diagnostics only: take the step whatever the logged post-state   *)
(*                                                                         *)
(* The code's Evict events come right before the BeginLoad that needed     *)
(* them, under the same lock hold.  The spec evicts inside BeginLoad, so   *)
(* an Evict event is a stuttering step that only checks its victim is      *)
(* evictable now (in the eviction order, at the logged range); the         *)
(* BeginLoad then takes a placement the spec allows at exactly the logged  *)
(* offset whose victims are exactly the keys of those Evict events.  A     *)
(* BeginLoad that fails or is refused (NOT_ADMITTED) evicts nothing: Evict *)
(* events before it are rejected at it.                                    *)
(*                                                                         *)
(* The code's no-op events are checked with the spec's own predicates:     *)
(* LookupIsNoOp, BeginLoadFails, RefuseBeginLoad and RemoveIsNoOp.  Each   *)
(* Release is its own step, so the order in which a closing request        *)
(* releases its pins is whatever the trace says.                           *)
(***************************************************************************)
EXTENDS EmbeddingCache, Integers

CONSTANTS
    Events,  \* the distinct event records
    Traces   \* a sequence of traces, each a sequence of indices into Events

VARIABLES t, i    \* the trace followed, and the index of its next event

traceVars == <<vars, t, i>>

NoOp(P) == P /\ UNCHANGED vars

\* A Lookup that misses on a shape or dtype mismatch is a no-op in any state
\* where the key is present (the spec does not model shapes).  A miss names its
\* reason (MISS:not_found, MISS:busy, MISS:mismatch); a bare MISS (an older
\* trace) is accepted wherever some reason could apply.
LookupMismatch(r, k) == request[r] = "open"

\* The spec action the event names, with its parameters.
Act(e) ==
    LET r == e.r
        k == e.k
    IN  CASE e.a = "OpenRequest"                -> OpenRequest(r)
          [] e.a = "CloseRequest"               -> CloseRequest(r)
          [] e.a = "Lookup" /\ e.out = "MISS:not_found" ->
                NoOp(request[r] = "open" /\ entry[k].state = ABSENT)
          [] e.a = "Lookup" /\ e.out = "MISS:busy" ->
                NoOp(request[r] = "open" /\ (entry[k].doomed \/ entry[k].state = QUARANTINED))
          [] e.a = "Lookup" /\ e.out = "MISS:mismatch" ->
                NoOp(LookupMismatch(r, k) /\ entry[k].state # ABSENT)
          [] e.a = "Lookup" /\ e.out = "MISS"   -> NoOp(LookupIsNoOp(r, k) \/ LookupMismatch(r, k))
          [] e.a = "Lookup" /\ e.out \in {"HIT", "LOADING", "RESERVED"} ->
                Lookup(r, k) \/ NoOp(LookupIsNoOp(r, k))
          [] e.a = "BeginLoad" /\ e.out = "OK"  -> BeginLoad(r, k, e.n)
          [] e.a = "BeginLoad" /\ e.out = "NOT_ADMITTED" -> RefuseBeginLoad(r, k, e.n)
          [] e.a = "BeginLoad" /\ e.out \in {"NO_SPACE", "TOO_LARGE"} ->
                NoOp(BeginLoadFails(r, k, e.n))
          [] e.a = "Evict"                      -> NoOp(k \in OrderSet)
          [] e.a = "EndLoad"                    -> EndLoad(k, e.out)
          [] e.a = "Release"                    -> Release(r, k)
          [] e.a = "Remove"                     -> Remove(k) \/ NoOp(RemoveIsNoOp(k))
          [] e.a = "Publish"                    -> Publish(r, k)
          [] e.a = "EndPublish"                 -> EndPublish(r, k, e.out)
          [] e.a = "BeginFence"                 -> BeginFence(e.f)
          [] e.a = "Fence"                      -> Fence(e.f)
          [] OTHER                              -> FALSE

\* An entry that becomes evictable in this step (its last pin released, a
\* load ended with no waiters) enters the order where the event says.  This
\* also keeps the trace spec deterministic (see tla/README.md).
EnteredAsLogged(e) ==
    e.k \in OrderSet' /\ e.k \notin OrderSet =>
        IF e.at = -1 THEN order' = Append(order, e.k)
        ELSE e.at < Len(order') /\ order'[e.at + 1] = e.k

\* What the event says beyond the action's parameters: the outcome of a
\* Lookup, the placement and victims of a BeginLoad (none if it failed or
\* was refused), the victim of an Evict, the snapshot of a BeginFence and the
\* keys a Fence freed, where an entry entered the order.
Match(e) ==
    /\ CASE e.a = "Lookup" /\ e.out = "HIT"  -> e.r \in entry'[e.k].holders
         [] e.a = "Lookup" /\ e.out \in {"LOADING", "RESERVED"} -> e.r \in entry'[e.k].waiters
         [] e.a = "BeginLoad" /\ e.out = "OK" ->
                /\ entry'[e.k].off = e.o
                /\ {j \in Keys : entry[j].state # ABSENT /\ entry'[j].state = ABSENT} = e.V
         [] e.a = "BeginLoad" /\ e.out = "TOO_LARGE" -> e.n > Units /\ e.V = {}
         [] e.a = "BeginLoad" -> e.V = {}
         [] e.a = "Evict" -> entry[e.k].off = e.o /\ entry[e.k].size = e.n
         [] e.a = "BeginFence" -> snapshot'[e.f] = e.Q
         [] e.a = "Fence" ->
                {j \in Keys : entry[j].state # ABSENT /\ entry'[j].state = ABSENT} = e.Q
         [] OTHER -> TRUE
    /\ EnteredAsLogged(e)

\* The entry's post-state as the code logged it.  A freed entry is checked
\* to be ABSENT (the code's record of it keeps stale fields).
Post(e) ==
    ~e.x /\ e.a # "Evict" /\ e.k # "" =>
        LET x == entry'[e.k] IN
        IF ~e.e THEN x.state = ABSENT
        ELSE /\ x.state = e.st
             /\ e.st = ABSENT => e.h = {} /\ e.w = {}
             /\ e.st # ABSENT =>
                    /\ x.off = e.o /\ x.size = e.n
                    /\ x.holders = e.h /\ x.waiters = e.w /\ x.publisher = e.p
                    /\ x.doomed = e.d /\ x.quarantinePending = e.q

Step(e) == Act(e) /\ Match(e) /\ Post(e)

TraceInit == Init /\ t \in DOMAIN Traces /\ i = 1

TraceNext ==
    \/ /\ i <= Len(Traces[t])
       /\ Step(Events[Traces[t][i]])
       /\ i' = i + 1
       /\ t' = t
    \/ /\ i > Len(Traces[t])     \* the whole trace is explained: stutter
       /\ UNCHANGED traceVars

-----------------------------------------------------------------------------
(* Diagnostics, for one rejected trace: which part of the step failed.     *)
(* Checked as invariants, in this order, after the spec's invariants.      *)

Pending == i <= Len(Traces[t])
NextEvent == Events[Traces[t][i]]
ActionEnabled  == Pending => ENABLED Act(NextEvent)
ActionMatches  == Pending => ENABLED (Act(NextEvent) /\ Match(NextEvent))
EventExplained == Pending => ENABLED Step(NextEvent)
\* With x set on the event whose post-state differs: the spec's post-state.
BeforeLaxEvent == i > 1 => ~Events[Traces[t][i - 1]].x
=============================================================================
