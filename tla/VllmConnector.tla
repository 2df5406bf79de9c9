---------------------------- MODULE VllmConnector ----------------------------
(***************************************************************************)
(* embcache as a vLLM encoder-cache connector: one scheduler connector     *)
(* that owns the cache over a shared pool, and one worker connector per    *)
(* rank that copies pool ranges into its encoder_cache.  The design is     *)
(* DESIGN.md, "vLLM: the scheduler/worker split"; the actions have its     *)
(* step names.  What vLLM needs: once has_cache_item(k) said True for r,   *)
(* every rank finds k's bytes in its encoder_cache when it runs r's step   *)
(* (else _gather_mm_embeddings raises "Encoder cache miss" and the engine  *)
(* dies, or, worse, it reads another item's bytes).                        *)
(*                                                                         *)
(* Theory of operation.                                                    *)
(*  - The cache is abstracted to what the connector relies on: an entry    *)
(*    per key (ABSENT, LOADING, READY) in one pool slot, holders (pins)    *)
(*    and waiters; EmbeddingCache.tla checks the cache itself.  `pool[s]`  *)
(*    is what a rank copying slot s gets: the key whose bytes are there,   *)
(*    or Garbage once the slot is freed or being written.                  *)
(*  - The cache may load (a prefetch, an insert of a fresh output) any     *)
(*    absent key into a free slot and evict any idle READY entry at any    *)
(*    time: that is the eviction pressure, as hostile as it can be.        *)
(*  - A vLLM request is used once (no slots reused): Ensure, HasItem,      *)
(*    Alloc, then Finish at any time (an abort included).  The actions of *)
(*    different requests, of the ranks and of the cache interleave freely; *)
(*    vLLM's order within one engine step is one of these interleavings.   *)
(*    One order is assumed: has_cache_item names no request, so the       *)
(*    connector answers for the request of the last Ensure (`current`),    *)
(*    and vLLM asks for r's items only while r is current.                 *)
(*  - BuildMeta ships the step's metadata (its loads and the items it      *)
(*    declared present) to every rank, in order.  A rank takes it in one   *)
(*    step, WorkerLoad: it copies each load's slot, runs the model on the  *)
(*    declared items (a wrong or missing tensor is recorded in `errors`)   *)
(*    and sends one ack per load.  A rank may be slow without bound, and   *)
(*    an ack may be lost (DropAck).                                        *)
(*  - Death is not slowness.  A rank may die (Die: its process exits; it   *)
(*    runs no step any more).  The connector cannot tell a dead rank from  *)
(*    a slow one until vLLM says so (LearnDeath: the worker's process      *)
(*    exited); a timeout says nothing about it.  Once a death is known,    *)
(*    the dead rank owes nothing (it reads nothing more), and when it is   *)
(*    Rank0 its fills end UNKNOWN and are fenced (it writes nothing more). *)
(*  - The connector's own bookkeeping is `owed`: the (rank, load) pairs    *)
(*    whose ack has not come.  A request's pins end when it finished and   *)
(*    nothing of it is owed; LoseAck (the hold timeout) only marks it      *)
(*    quarantined: its pins stay, for ever or until the late acks come or  *)
(*    the owing rank is known dead.                                        *)
(*  - The producer path (when Producer): an item r encodes gets a pool     *)
(*    slot reserved for it, a LOADING entry that r fills (AllocSave);      *)
(*    Rank0 writes the fresh output straight into that slot in its         *)
(*    WorkerLoad and acks; the ack makes the entry READY, pinned by r      *)
(*    (AckSave).  A save ack overdue (LoseAck) ends the fill UNKNOWN: the  *)
(*    entry is QUARANTINED, its slot held until a fence frees it once      *)
(*    Rank0's late ack came or Rank0 is known dead (FenceFill): Rank0 may  *)
(*    only be slow, and a timeout says nothing about that.                 *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets

CONSTANTS
    Keys,      \* the items' identifiers (mm hashes)
    Requests,  \* vLLM requests, each used once
    Ranks,     \* worker ranks (TP x PP): each one needs every declared item
    Slots,     \* pool slots: an entry takes one
    Producer,  \* TRUE: the producer path runs (fresh outputs are cached)
    Rank0,     \* the rank that writes fresh outputs into the pool (save_caches)
    Mortal,    \* the ranks that may die (a model keeps its state space with {})
    Garbage,   \* a model value: the bytes of a freed or half-written slot
    NoSlot     \* a model value: the slot of an ABSENT entry

ASSUME /\ Garbage \notin Keys
       /\ NoSlot \notin Slots
       /\ Rank0 \in Ranks
       /\ Mortal \subseteq Ranks
       /\ Producer \in BOOLEAN

ABSENT  == "ABSENT"
LOADING == "LOADING"
READY   == "READY"
FENCED  == "QUARANTINED"  \* a fill ended UNKNOWN: the slot is held until a fence

\* vLLM's view of a request, from the connector's side.
UNSEEN      == "unseen"       \* no Ensure yet
WAITING     == "waiting"      \* looked up; deferred while it waits on a LOADING item
ENSURED     == "ensured"      \* its present items are known: it may be scheduled
FINISHED    == "finished"     \* request_finished; acks still owed
QUARANTINED == "quarantined"  \* LoseAck: acks overdue; the pins stay
CLOSED      == "closed"       \* its embcache request closed: no pins, no waits
Live == {UNSEEN, WAITING, ENSURED}
NoRequest == "none"

VARIABLES
    entry,     \* entry[k]: [state, slot, holders, waiters, filler]
    free,      \* the free pool slots
    pool,      \* pool[s]: whose bytes slot s holds (Garbage: none valid)
    request,   \* request[r]: one of the states above
    items,     \* items[r]: the keys of r's multimodal inputs
    current,   \* the request of the last Ensure that returned True (this step)
    declared,  \* <<r, k>>: has_cache_item(k) said True for r, not yet Alloc'ed
    allocated, \* <<r, k>>: Alloc'ed; vLLM's encoder cache has it and never asks again
    meta,      \* the step's metadata being built: [loads, declared]
    inbox,     \* inbox[w]: the steps' metadata rank w has not yet run
    owed,      \* <<w, l>>: the connector waits for rank w's ack of load l
    acks,      \* <<w, l>>: acks on their way to the scheduler
    errors,    \* what ranks found wrong: [rank, req, key, got] (a history)
    saving,    \* the saves whose ack from Rank0 the connector waits for
    sacks,     \* Rank0's save acks on their way to the scheduler
    dead,      \* the ranks whose process exited
    known,     \* the ranks the connector knows dead (vLLM told it)
    writing    \* fills ended UNKNOWN at the timeout that Rank0 may still write

SaveVars == <<saving, sacks>>
Fate == <<dead, known, writing>>
vars == <<entry, free, pool, request, items, current, declared, allocated, meta, inbox, owed,
          acks, errors, SaveVars, Fate>>

NoEntry == [state |-> ABSENT, slot |-> NoSlot, holders |-> {}, waiters |-> {}, filler |-> NoRequest]
Load(r, k) == [req |-> r, key |-> k, slot |-> entry[k].slot]
Loads == [req : Requests, key : Keys, slot : Slots]
Saves == [req : Requests, key : Keys, slot : Slots]
Message == [loads : SUBSET Loads, saves : SUBSET Saves, declared : SUBSET (Requests \X Keys)]
EmptyMeta == [loads |-> {}, saves |-> {}, declared |-> {}]
Nothing == "Nothing"  \* no tensor in encoder_cache

OwedBy(r) == {p \in owed : p[2].req = r}
\* An ack of r is owed: of a load by some rank, or of a save by Rank0.
Outstanding(r) == OwedBy(r) # {} \/ \E sv \in saving : sv.req = r

\* Drop r's pins on the keys K and its waits everywhere.
ReleaseAll(r, K) ==
    entry' = [k \in Keys |-> [entry[k] EXCEPT
                  !.holders = IF k \in K THEN @ \ {r} ELSE @,
                  !.waiters = @ \ {r}]]

-----------------------------------------------------------------------------
(* The cache: loads and evictions, at any time. *)

\* A prefetch, a store read or the copy of a fresh encoder output: it
\* reserves a free slot, whose bytes are not valid until EndLoad.
BeginLoad(k) ==
    /\ entry[k].state = ABSENT
    /\ \E s \in free :
         /\ entry' = [entry EXCEPT ![k] = [NoEntry EXCEPT !.state = LOADING, !.slot = s]]
         /\ free' = free \ {s}
         /\ pool' = [pool EXCEPT ![s] = Garbage]
    /\ UNCHANGED <<request, items, current, declared, allocated, meta, inbox, owed, acks, errors,
                   SaveVars>>
    /\ UNCHANGED Fate

\* OK: READY, and the waiters (deferred requests) become holders in the same
\* step.  FAILED: the slot is freed; the waiters will encode.
EndLoad(k, ok) ==
    LET e == entry[k] IN
    /\ e.state = LOADING
    /\ e.filler = NoRequest  \* a fill ends only with Rank0's ack (AckSave) or LoseAck
    /\ IF ok
         THEN /\ entry' = [entry EXCEPT ![k] = [e EXCEPT !.state = READY,
                                                !.holders = e.waiters, !.waiters = {}]]
              /\ pool' = [pool EXCEPT ![e.slot] = k]
              /\ UNCHANGED free
         ELSE /\ entry' = [entry EXCEPT ![k] = NoEntry]
              /\ free' = free \cup {e.slot}
              /\ UNCHANGED pool
    /\ UNCHANGED <<request, items, current, declared, allocated, meta, inbox, owed, acks, errors,
                   SaveVars>>
    /\ UNCHANGED Fate

\* Any idle READY entry may be evicted at any time: its slot is free, and
\* its bytes may be overwritten at once.
Evict(k) ==
    /\ entry[k].state = READY
    /\ entry[k].holders = {}
    /\ entry' = [entry EXCEPT ![k] = NoEntry]
    /\ free' = free \cup {entry[k].slot}
    /\ pool' = [pool EXCEPT ![entry[k].slot] = Garbage]
    /\ UNCHANGED <<request, items, current, declared, allocated, meta, inbox, owed, acks, errors,
                   SaveVars>>
    /\ UNCHANGED Fate

-----------------------------------------------------------------------------
(* The scheduler connector: vLLM's calls, in the engine-core process. *)

\* ensure_cache_available(r).  At its first call, a lookup of r's items:
\* READY ones are pinned for r, LOADING ones (a store read, which the lookup
\* itself may have started: BeginLoad just before) get r as a waiter.  While
\* r waits on any, it returns False and vLLM defers r; once r waits on
\* nothing, r's present items are the ones it pins (a failed load fell
\* back: encoded), it returns True and r is current.  No second lookup.
Ensure(r) ==
    /\ request[r] \in {UNSEEN, WAITING, ENSURED}
    /\ IF request[r] = UNSEEN
         THEN LET Hit  == {k \in items[r] : entry[k].state = READY}
                  Join == {k \in items[r] : entry[k].state = LOADING}
              IN  /\ entry' = [k \in Keys |-> [entry[k] EXCEPT
                                   !.holders = IF k \in Hit THEN @ \cup {r} ELSE @,
                                   !.waiters = IF k \in Join THEN @ \cup {r} ELSE @]]
                  /\ request' = [request EXCEPT ![r] = IF Join = {} THEN ENSURED ELSE WAITING]
                  /\ current' = IF Join = {} THEN r ELSE NoRequest
         ELSE LET waits == \E k \in Keys : r \in entry[k].waiters
              IN  /\ request' = [request EXCEPT ![r] = IF waits THEN WAITING ELSE ENSURED]
                  /\ current' = IF waits THEN NoRequest ELSE r
                  /\ UNCHANGED entry
    /\ UNCHANGED <<free, pool, items, declared, allocated, meta, inbox, owed, acks, errors,
                   SaveVars>>
    /\ UNCHANGED Fate

\* has_cache_item(k) while vLLM schedules r's encoder inputs (r is current:
\* vLLM calls ensure_cache_available(r) just before): True only for an item
\* r pins.  (A False answer changes nothing: r encodes k.)
HasItem(r, k) ==
    /\ current = r
    /\ k \in items[r]
    /\ <<r, k>> \notin declared \cup allocated
    /\ r \in entry[k].holders
    /\ declared' = declared \cup {<<r, k>>}
    /\ UNCHANGED <<entry, free, pool, request, items, current, allocated, meta, inbox, owed, acks,
                   errors, SaveVars>>
    /\ UNCHANGED Fate

\* update_state_after_alloc(r, i) for an item declared present: a load of
\* its slot joins the step's metadata, owed an ack by every rank, unless a
\* load of that key is in this step already (one per key and step).
Alloc(r, k) ==
    /\ <<r, k>> \in declared
    /\ request[r] = ENSURED
    /\ declared' = declared \ {<<r, k>>}
    /\ allocated' = allocated \cup {<<r, k>>}
    /\ IF r \in entry[k].holders /\ ~\E l \in meta.loads : l.key = k
         THEN /\ meta' = [meta EXCEPT !.loads = @ \cup {Load(r, k)},
                                      !.declared = @ \cup {<<r, k>>}]
              /\ owed' = owed \cup ((Ranks \ known) \X {Load(r, k)})
         ELSE /\ meta' = [meta EXCEPT !.declared = @ \cup {<<r, k>>}]
              /\ UNCHANGED owed
    /\ UNCHANGED <<entry, free, pool, request, items, current, inbox, acks, errors, SaveVars>>
    /\ UNCHANGED Fate

\* build_connector_meta ends the step: its metadata goes, pickled inside
\* SchedulerOutput, to every rank (a step without loads sends nothing the
\* ranks act on); answers not allocated are forgotten (r was not scheduled;
\* vLLM asks again), and no request is current.
BuildMeta ==
    /\ meta # EmptyMeta \/ declared # {} \/ current # NoRequest
    /\ inbox' = IF meta = EmptyMeta THEN inbox ELSE [w \in Ranks |-> Append(inbox[w], meta)]
    /\ meta' = EmptyMeta
    /\ declared' = {}
    /\ current' = NoRequest
    /\ UNCHANGED <<entry, free, pool, request, items, allocated, owed, acks, errors, SaveVars>>
    /\ UNCHANGED Fate

\* request_finished(r), or an abort, at any time: r's waits and unallocated
\* answers go; its pins stay until nothing of it is owed.
Finish(r) ==
    /\ request[r] \in Live
    /\ declared' = {d \in declared : d[1] # r}
    /\ current' = IF current = r THEN NoRequest ELSE current
    /\ IF ~Outstanding(r)
         THEN ReleaseAll(r, Keys) /\ request' = [request EXCEPT ![r] = CLOSED]
         ELSE ReleaseAll(r, {}) /\ request' = [request EXCEPT ![r] = FINISHED]
    /\ UNCHANGED <<free, pool, items, allocated, meta, inbox, owed, acks, errors, SaveVars>>
    /\ UNCHANGED Fate

\* update_connector_output with rank w's ack of load l.  When nothing of a
\* finished (or quarantined: a late ack) request is owed any more, its pins
\* end and its embcache request closes.
Ack(w, l) ==
    /\ <<w, l>> \in acks
    /\ acks' = acks \ {<<w, l>>}
    /\ owed' = owed \ {<<w, l>>}
    /\ LET r == l.req IN
       IF /\ request[r] \in {FINISHED, QUARANTINED}
          /\ ~\E p \in owed' : p[2].req = r
          /\ ~\E sv \in saving : sv.req = r
         THEN ReleaseAll(r, Keys) /\ request' = [request EXCEPT ![r] = CLOSED]
         ELSE UNCHANGED <<entry, request>>
    /\ UNCHANGED <<free, pool, items, current, declared, allocated, meta, inbox, errors, SaveVars>>
    /\ UNCHANGED Fate

\* The hold timeout: acks owed for a finished request are overdue, perhaps
\* lost, perhaps only slow.  The request is quarantined: its pins stay, never
\* released, evicted or reused (a rank may still read them); only late acks,
\* or the owing rank's known death (LearnDeath), end them.  Its fills end
\* UNKNOWN (QUARANTINED: their waiters encode instead of waiting) and stay
\* `writing`: Rank0 may still write them, so no fence frees them until its
\* late ack or its known death.
LoseAck(r) ==
    /\ request[r] = FINISHED
    /\ LET lost == {sv \in saving : sv.req = r}
           K == {sv.key : sv \in {o \in lost : entry[o.key].filler = r}}
           closes == OwedBy(r) = {}
       IN  /\ saving' = saving \ lost
           /\ writing' = writing \cup lost
           /\ entry' = [k \in Keys |-> IF k \in K
                            THEN [entry[k] EXCEPT !.state = FENCED, !.filler = NoRequest,
                                                  !.waiters = {}]
                            ELSE IF closes THEN [entry[k] EXCEPT !.holders = @ \ {r}]
                            ELSE entry[k]]
           /\ request' = [request EXCEPT ![r] = IF closes THEN CLOSED ELSE QUARANTINED]
    /\ UNCHANGED <<free, pool, items, current, declared, allocated, meta, inbox, owed,
                   acks, errors, sacks>>
    /\ UNCHANGED <<dead, known>>

\* A rank's process exits (killed, crashed): it runs no step any more; its
\* acks already sent may still arrive.  Nothing tells the connector: until
\* LearnDeath a dead rank looks exactly like a slow one.
Die(w) ==
    /\ w \in Mortal \ dead
    /\ dead' = dead \cup {w}
    /\ UNCHANGED <<entry, free, pool, request, items, current, declared, allocated, meta, inbox,
                   owed, acks, errors, SaveVars, known, writing>>

\* vLLM tells the connector that w died (its worker process exited).  w
\* reads nothing more: the loads it owes are owed no more.  If w is Rank0 it
\* writes nothing more: its fills end UNKNOWN (QUARANTINED, freed by
\* FenceFill).  A finished or quarantined request owing nothing closes.
LearnDeath(w) ==
    /\ w \in dead \ known
    /\ known' = known \cup {w}
    /\ owed' = {p \in owed : p[1] # w}
    /\ writing' = IF w = Rank0 THEN {} ELSE writing
    /\ LET lost == IF w = Rank0 THEN saving ELSE {}
           K == {sv.key : sv \in {o \in lost : /\ entry[o.key].filler = o.req
                                                /\ entry[o.key].slot = o.slot}}
           closes(r) == /\ request[r] \in {FINISHED, QUARANTINED}
                        /\ ~\E p \in owed' : p[2].req = r
                        /\ ~\E sv \in saving \ lost : sv.req = r
           closed == {r \in Requests : closes(r)}
       IN  /\ saving' = saving \ lost
           /\ entry' = [k \in Keys |->
                           IF k \in K
                             THEN [entry[k] EXCEPT !.state = FENCED, !.filler = NoRequest,
                                                   !.waiters = {}, !.holders = {}]
                             ELSE [entry[k] EXCEPT !.holders = @ \ closed]]
           /\ request' = [r \in Requests |-> IF r \in closed THEN CLOSED ELSE request[r]]
    /\ UNCHANGED <<free, pool, items, current, declared, allocated, meta, inbox, acks, errors,
                   sacks, dead>>

-----------------------------------------------------------------------------
(* The producer path: fresh encoder outputs, written by Rank0 into the pool. *)

\* update_state_after_alloc(r, i) for an item r does not have (vLLM encodes
\* it), in a producer role: a free pool slot is reserved, a LOADING entry
\* that r fills (Request.begin_fill), and a save joins the step's metadata
\* (no free slot: no save; one per key and step).  Rank0 writes the fresh
\* output into the slot and acks.
AllocSave(r, k) ==
    /\ Producer
    /\ Rank0 \notin known  \* nobody would write it
    /\ request[r] = ENSURED
    /\ k \in items[r]
    /\ <<r, k>> \notin declared \cup allocated
    /\ entry[k].state = ABSENT
    /\ ~\E sv \in meta.saves : sv.key = k
    /\ \E s \in free :
         /\ entry' = [entry EXCEPT ![k] = [NoEntry EXCEPT !.state = LOADING, !.slot = s,
                                                         !.filler = r]]
         /\ free' = free \ {s}
         /\ pool' = [pool EXCEPT ![s] = Garbage]
         /\ meta' = [meta EXCEPT !.saves = @ \cup {[req |-> r, key |-> k, slot |-> s]}]
         /\ saving' = saving \cup {[req |-> r, key |-> k, slot |-> s]}
    /\ allocated' = allocated \cup {<<r, k>>}
    /\ UNCHANGED <<request, items, current, declared, inbox, owed, acks, errors, sacks>>
    /\ UNCHANGED Fate

\* update_connector_output with Rank0's ack of save sv: the fill ends OK,
\* the entry is READY and pinned by r (Request.end_fill); a finished
\* request with nothing else owed closes.  An ack of a save the connector
\* no longer waits for (its fill ended UNKNOWN at LoseAck) is ignored.
AckSave(sv) ==
    /\ sv \in sacks
    /\ sacks' = sacks \ {sv}
    /\ IF sv \in saving /\ entry[sv.key].filler = sv.req /\ entry[sv.key].slot = sv.slot
         THEN LET r == sv.req
                  closes == /\ request[r] \in {FINISHED, QUARANTINED}
                            /\ OwedBy(r) = {}
                            /\ ~\E o \in saving \ {sv} : o.req = r
                  e == entry[sv.key]
                  e1 == [entry EXCEPT ![sv.key] = [e EXCEPT !.state = READY, !.filler = NoRequest,
                                                   !.holders = e.holders \cup e.waiters \cup {r},
                                                   !.waiters = {}]]
              IN  /\ saving' = saving \ {sv}
                  /\ entry' = IF closes
                               THEN [k \in Keys |-> [e1[k] EXCEPT !.holders = @ \ {r},
                                                                 !.waiters = @ \ {r}]]
                               ELSE e1
                  /\ request' = IF closes THEN [request EXCEPT ![r] = CLOSED] ELSE request
         ELSE /\ saving' = saving \ {sv}
              /\ UNCHANGED <<entry, request>>
    /\ writing' = writing \ {sv}  \* a late ack: that write is over
    /\ UNCHANGED <<free, pool, items, current, declared, allocated, meta, inbox, owed, acks,
                   errors>>
    /\ UNCHANGED <<dead, known>>

\* A save ack that never arrives: the fill stays LOADING until LoseAck.
DropSaveAck(sv) ==
    /\ sv \in sacks
    /\ sacks' = sacks \ {sv}
    /\ UNCHANGED <<entry, free, pool, request, items, current, declared, allocated, meta, inbox,
                   owed, acks, errors, saving>>
    /\ UNCHANGED Fate

\* The fence of a QUARANTINED fill: its slot is freed once no write of it by
\* Rank0 can land any more, which the connector knows only from Rank0's late
\* ack of it or Rank0's known death (until then Rank0 may only be slow: a step
\* it has still to run may write it).
FenceFill(k) ==
    /\ entry[k].state = FENCED
    /\ Rank0 \in known \/ ~\E sv \in writing : sv.key = k /\ sv.slot = entry[k].slot
    /\ entry' = [entry EXCEPT ![k] = NoEntry]
    /\ free' = free \cup {entry[k].slot}
    /\ UNCHANGED <<pool, request, items, current, declared, allocated, meta, inbox, owed, acks,
                   errors, SaveVars>>
    /\ UNCHANGED Fate

-----------------------------------------------------------------------------
(* The worker connectors: one per rank, in the GPU worker processes. *)

\* Rank w runs the oldest step it has not run: start_load_caches copies each
\* load's slot into encoder_cache, the model reads every declared item
\* (recorded in `errors` when the tensor is missing or holds other bytes),
\* and build_connector_worker_meta acks each load.
WorkerLoad(w) ==
    /\ w \notin dead
    /\ inbox[w] # <<>>
    /\ LET m == Head(inbox[w])
           got(k) == IF \E l \in m.loads : l.key = k
                       THEN pool[(CHOOSE l \in m.loads : l.key = k).slot]
                       ELSE Nothing
       IN  /\ errors' = errors \cup {[rank |-> w, req |-> d[1], key |-> d[2],
                                      got |-> got(d[2])] : d \in {d \in m.declared :
                                                                 got(d[2]) # d[2]}}
           /\ acks' = acks \cup ({w} \X m.loads)
           /\ IF w = Rank0
                THEN /\ pool' = [s \in Slots |->
                                    IF \E sv \in m.saves : sv.slot = s
                                      THEN (CHOOSE sv \in m.saves : sv.slot = s).key
                                      ELSE pool[s]]
                     /\ sacks' = sacks \cup m.saves
                ELSE UNCHANGED <<pool, sacks>>
    /\ inbox' = [inbox EXCEPT ![w] = Tail(@)]
    /\ UNCHANGED <<entry, free, request, items, current, declared, allocated, meta, owed,
                   saving>>
    /\ UNCHANGED Fate

\* An ack that never arrives: a killed worker, a lost message.
DropAck(w, l) ==
    /\ <<w, l>> \in acks
    /\ acks' = acks \ {<<w, l>>}
    /\ UNCHANGED <<entry, free, pool, request, items, current, declared, allocated, meta, inbox,
                   owed, errors, SaveVars>>
    /\ UNCHANGED Fate

\* Every request is closed or quarantined and nothing is in flight: the
\* behaviour ends here (a stuttering step, so that TLC's deadlock check
\* still flags any other state where nothing can happen).
Done ==
    /\ \A r \in Requests : request[r] \in {CLOSED, QUARANTINED}
    /\ meta = EmptyMeta /\ acks = {} /\ sacks = {} /\ \A w \in Ranks \ dead : inbox[w] = <<>>
    /\ UNCHANGED vars

-----------------------------------------------------------------------------

Init ==
    /\ entry = [k \in Keys |-> NoEntry]
    /\ free = Slots
    /\ pool = [s \in Slots |-> Garbage]
    /\ request = [r \in Requests |-> UNSEEN]
    /\ items \in [Requests -> SUBSET Keys \ {{}}]
    /\ current = NoRequest
    /\ declared = {}
    /\ allocated = {}
    /\ meta = EmptyMeta
    /\ inbox = [w \in Ranks |-> <<>>]
    /\ owed = {}
    /\ acks = {}
    /\ errors = {}
    /\ saving = {}
    /\ sacks = {}
    /\ dead = {}
    /\ known = {}
    /\ writing = {}

Next ==
    \/ \E k \in Keys : BeginLoad(k) \/ EndLoad(k, TRUE) \/ EndLoad(k, FALSE) \/ Evict(k)
                     \/ FenceFill(k)
    \/ \E r \in Requests : Ensure(r) \/ Finish(r) \/ LoseAck(r)
    \/ \E r \in Requests, k \in Keys : HasItem(r, k) \/ Alloc(r, k) \/ AllocSave(r, k)
    \/ \E sv \in Saves : AckSave(sv) \/ DropSaveAck(sv)
    \/ BuildMeta
    \/ \E w \in Ranks : WorkerLoad(w) \/ Die(w) \/ LearnDeath(w)
    \/ \E w \in Ranks, l \in Loads : Ack(w, l) \/ DropAck(w, l)
    \/ Done

Spec == Init /\ [][Next]_vars

-----------------------------------------------------------------------------
(* Invariants. *)

Entry == [state : {ABSENT, LOADING, READY, FENCED}, slot : Slots \cup {NoSlot},
          holders : SUBSET Requests, waiters : SUBSET Requests,
          filler : Requests \cup {NoRequest}]

TypeOK ==
    /\ entry \in [Keys -> Entry]
    /\ \A k \in Keys : entry[k].state = ABSENT => entry[k] = NoEntry
    /\ free \subseteq Slots
    /\ pool \in [Slots -> Keys \cup {Garbage}]
    /\ request \in [Requests -> Live \cup {FINISHED, QUARANTINED, CLOSED}]
    /\ items \in [Requests -> SUBSET Keys]
    /\ current \in Requests \cup {NoRequest}
    /\ declared \subseteq Requests \X Keys
    /\ allocated \subseteq Requests \X Keys
    /\ meta \in Message
    /\ \A w \in Ranks : inbox[w] \in Seq(Message)
    /\ owed \subseteq Ranks \X Loads
    /\ acks \subseteq Ranks \X Loads
    /\ errors \subseteq [rank : Ranks, req : Requests, key : Keys,
                         got : Keys \cup {Garbage, Nothing}]
    /\ saving \subseteq Saves
    /\ sacks \subseteq Saves
    /\ dead \subseteq Ranks
    /\ known \subseteq Ranks
    /\ writing \subseteq Saves

\* The connector knows a rank dead only if its process exited (no death is
\* presumed from a timeout).
KnownIsDead == known \subseteq dead

\* A fill Rank0 may still write keeps its slot: QUARANTINED, in that slot,
\* until Rank0's late ack or its known death (a timeout alone frees nothing).
WritingHeld == \A sv \in writing : entry[sv.key].state = FENCED /\ entry[sv.key].slot = sv.slot

\* What vLLM sees.  Every item a rank's model run needed was in its
\* encoder_cache (else: RuntimeError "Encoder cache miss", the engine dies) ...
NoEncoderCacheMiss == \A e \in errors : e.got # Nothing

\* ... and held that item's bytes, not a freed slot's or another item's.
RightBytes == \A e \in errors : e.got = Nothing

\* What a later load would deliver: a READY entry's slot holds its bytes
\* (a fill's slot freed and reused while Rank0 may still write it breaks it).
CachedBytesRight == \A k \in Keys : entry[k].state = READY => pool[entry[k].slot] = k

\* The slots: an entry's slot is not free and no other entry's; a READY
\* entry's slot holds its bytes.
SlotsExact ==
    /\ \A k \in Keys : entry[k].state # ABSENT => entry[k].slot \notin free
    /\ \A j, k \in Keys : j # k /\ entry[j].state # ABSENT /\ entry[k].state # ABSENT
                            => entry[j].slot # entry[k].slot
    /\ \A k \in Keys : entry[k].holders # {} => entry[k].state = READY
    /\ \A k \in Keys : entry[k].waiters # {} => entry[k].state = LOADING

\* The property: an item declared present (HasItem said True) is READY and
\* pinned by its request until it is allocated, then has a load in the
\* step's metadata whose slot holds it, pinned by the load's request (one
\* load per key and step), until every rank has run that step.
Pinned(r, k) == entry[k].state = READY /\ r \in entry[k].holders
\* (A dead rank runs no step: what its inbox holds is never read, and the
\* step being built is read by nobody once every rank is dead.)
Alive == Ranks \ dead
InFlight == (IF Alive = {} THEN {} ELSE {meta})
            \cup UNION {{inbox[w][i] : i \in 1..Len(inbox[w])} : w \in Alive}
DeclaredIsPinned ==
    /\ \A d \in declared : Pinned(d[1], d[2])
    /\ \A m \in InFlight : \A d \in m.declared :
           \E l \in m.loads : /\ l.key = d[2]
                              /\ Pinned(l.req, l.key) /\ entry[l.key].slot = l.slot

\* A save the connector waits for is its request's fill: a LOADING entry of
\* its key, in its slot, not free; a fill is a save the connector waits for.
FillHeld ==
    /\ \A sv \in saving : /\ entry[sv.key].state = LOADING /\ entry[sv.key].filler = sv.req
                          /\ entry[sv.key].slot = sv.slot /\ sv.slot \notin free
    /\ \A k \in Keys : entry[k].filler # NoRequest =>
           \E sv \in saving : sv.key = k /\ sv.req = entry[k].filler

\* No pin outlives its request: a finished or quarantined request pins only
\* while an ack of it is owed, a closed one nothing; only a deferred request
\* waits; the current request is an ensured one.
NoPinOutlivesRequest ==
    /\ \A r \in Requests, k \in Keys :
           /\ r \in entry[k].waiters => request[r] = WAITING
           /\ r \in entry[k].holders =>
                  \/ request[r] \in Live
                  \/ request[r] \in {FINISHED, QUARANTINED} /\ Outstanding(r)
    /\ current # NoRequest => request[current] = ENSURED

=============================================================================
