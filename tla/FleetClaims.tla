----------------------------- MODULE FleetClaims -----------------------------
(***************************************************************************)
(* One encode per image across a fleet: encode workers on one Mooncake     *)
(* master claim a miss before they encode it.  The design is DESIGN.md,    *)
(* "Claims"; models/claims.py has the same actions, in snake case.         *)
(* What the fleet needs: every byte a worker serves is the encoder's       *)
(* output for its key (claims carry no bytes), no request waits on a claim *)
(* past its lease, and with no failure each key is encoded once.           *)
(*                                                                         *)
(* Theory of operation (embcache/pipeline/claims.py, MooncakeStore).      *)
(*  - The store holds, per key, the published object (`data`: none, a put  *)
(*    in progress, or complete; a get sees only a complete object) and a   *)
(*    claim under a key of its own (`claim`: its owner and what is left of *)
(*    its lease).  A claim is a put started and never ended: exactly one   *)
(*    of racing starts wins, the others are refused while the claim is     *)
(*    live, and once its lease ended (the master's timeout for abandoned  *)
(*    puts) the next start wins.  A put of the bytes is put-if-absent: the *)
(*    first put of a key wins, a put of an existing key stores nothing.     *)
(*    A release is a revoke, which the master refuses for a claim that is  *)
(*    not the releaser's (taken over after its lease, or after a restart). *)
(*  - A worker serves each key once (one request per worker and key; a    *)
(*    hit afterwards is local): Ask the store; on a miss, Claim.  A claim  *)
(*    won: look at the store once more (another's publish may have become *)
(*    visible since the miss: load it) and Encode, put the bytes           *)
(*    (BeginPublish; EndPublish: visible), then Release once the key is    *)
(*    stored (or the lease ended by the worker's own clock).  A claim      *)
(*    refused: WAITING (LOADING from the store) until a full lease from    *)
(*    when the wait began; each Poll loads the publish if it is visible,   *)
(*    else claims again, and wins (a takeover) once the claim it found has *)
(*    ended (released, expired, or gone with a restarted master).  A poll  *)
(*    asks, then claims: a publish and its release between the two give   *)
(*    it a claim on a stored key, which its second look loads.  Still     *)
(*    refused at the deadline: a newer claim (another waiter took the old *)
(*    one over), waited on for one more lease; after ClaimsWaited leases,  *)
(*    the waiter encodes itself with no claim (per-item fallback).        *)
(*  - Time is a logical clock of countdowns: a claim's lease, its owner's  *)
(*    view of it and a waiter's deadline count ticks down together (Tick). *)
(*    A waiter polls at least once per tick (polls are milliseconds apart, *)
(*    leases seconds), and unless claimers may be slow, a claimer encodes  *)
(*    and publishes within its lease.  Countdowns keep the state space     *)
(*    finite with behaviours unbounded in time.                            *)
(*  - Failures (the constant Faults): a claimer crashes mid-encode (its    *)
(*    claim stays until its lease ends), is slow (it works on past its     *)
(*    lease: its late publish is a duplicate, refused or first), its       *)
(*    encode fails (it releases at once), or the master restarts once     *)
(*    (every claim and object gone).  An expired claim leaves the store    *)
(*    (Expire: the master's discard) or is taken over by the next claim.   *)
(***************************************************************************)
EXTENDS Naturals, Integers, FiniteSets

CONSTANTS
    Workers,       \* encode worker processes sharing one master
    Keys,          \* images (mm hashes)
    Lease,         \* a claim's lease, in ticks
    ClaimsWaited,  \* the claims a waiter waits on, a lease each, before it encodes
    Faults,        \* the failures this model allows: a subset of AllFaults
    Garbage        \* a model value: bytes no encoder wrote (a half-written object)

CRASH   == "crash"    \* a claimer's process dies mid-encode
SLOW    == "slow"     \* a claimer works on past its lease
FAIL    == "fail"     \* a claimer's encode fails
RESTART == "restart"  \* the master restarts (once): every claim and object is gone
AllFaults == {CRASH, SLOW, FAIL, RESTART}

ASSUME /\ Lease \in Nat \ {0}
       /\ ClaimsWaited \in Nat \ {0}
       /\ Faults \subseteq AllFaults
       /\ Garbage \notin Keys

\* The encoder is deterministic: its output for key k is written k.
Enc(k) == k
Nobody  == "nobody"
NoBytes == "nobytes"

\* A worker's phase for one key.
IDLE       == "idle"        \* no request for the key yet
CLAIMING   == "claiming"    \* missed the store: about to claim the key
OWNED      == "owned"       \* its claim won: looks at the store once more, encodes
WAITING    == "waiting"     \* the claim was refused: LOADING from the store
FALLBACK   == "fallback"    \* its waits ended with no publish: encodes itself, no claim
PUBLISH    == "publish"     \* encoded: about to put the bytes
PUBLISHING == "publishing"  \* its put is in progress
RELEASE    == "release"     \* a claimer: releases once the key is stored (or its lease ended)
DONE       == "done"        \* served `got`
FAILED     == "failed"      \* its encode failed
DEAD       == "dead"        \* its process died
Terminal == {DONE, FAILED, DEAD}

\* The store's object of a key.
NONE     == "none"
WRITING  == "writing"   \* a put in progress: a get does not see it
COMPLETE == "complete"

VARIABLES
    data,      \* data[k]: [state, bytes, by]: the published object of k
    claim,     \* claim[k]: [owner, left]: k's claim and its lease left (NoClaim: none)
    ws,        \* ws[w][k]: worker w's work on key k (Idle's fields)
    encodes,   \* encodes[k]: how many times the fleet encoded k
    restarts   \* how many times the master restarted

vars == <<data, claim, ws, encodes, restarts>>

NoData  == [state |-> NONE, bytes |-> NoBytes, by |-> Nobody]
NoClaim == [owner |-> Nobody, left |-> 0]
\* own: w believes it holds k's claim; timer: that claim's lease left, as w
\* counts it (an owner), or the ticks to w's deadline (a waiter); lease: a
\* ghost, the lease left of the claim a waiter last found, as the store
\* counts it; rounds: the claims a waiter has waited on; polled: a waiter
\* polled since the last tick; got: the bytes w holds and serves; missed: a
\* ghost, the key was not stored at a waiter's last claim or poll, so the ask
\* of its next poll may still miss a publish visible since (Poll).
Idle == [phase |-> IDLE, own |-> FALSE, timer |-> 0, lease |-> 0, rounds |-> 0, polled |-> FALSE,
         got |-> NoBytes, missed |-> FALSE]

Dec(n) == IF n > 0 THEN n - 1 ELSE 0

\* Worker w's work on k becomes s; nothing else of w changes.
Set(w, k, s) == ws' = [ws EXCEPT ![w][k] = s]

\* After its publish: a claimer releases its claim, anyone else is done.
AfterPublish(s) == IF s.own THEN [s EXCEPT !.phase = RELEASE] ELSE [s EXCEPT !.phase = DONE]

\* The key is not stored (a get would miss it).
Missed(k) == data[k].state # COMPLETE

\* What the ask of w's poll of k may answer (stored or not): a poll asks
\* whether the key is stored and then claims it, two calls, so a publish and
\* its release may both land between them.  The poll is its claim's step,
\* and its ask came after w's last claim or poll: an object complete now may
\* have been missed if it was not complete then (a restart empties the store).
Looks(w, k) ==
    IF Missed(k) THEN {FALSE}
    ELSE IF ws[w][k].missed THEN {TRUE, FALSE}
    ELSE {TRUE}

\* A claim can be won: there is none, or its lease has ended.
Free(k) == claim[k] = NoClaim \/ claim[k].left = 0

\* w's claim of k wins: w holds it for a lease.
Take(w, k) ==
    /\ claim' = [claim EXCEPT ![k] = [owner |-> w, left |-> Lease]]
    /\ Set(w, k, [Idle EXCEPT !.phase = OWNED, !.own = TRUE, !.timer = Lease])

\* w revokes its claim of k: the master ends it only if it is w's.
RemoveClaim(w, k) ==
    claim' = IF claim[k].owner = w THEN [claim EXCEPT ![k] = NoClaim] ELSE claim

-----------------------------------------------------------------------------
(* A worker's steps for one key. *)

\* A request misses k at w; w asks the store (a get: only a complete object).
Ask(w, k) ==
    /\ ws[w][k].phase = IDLE
    /\ IF data[k].state = COMPLETE
         THEN Set(w, k, [Idle EXCEPT !.phase = DONE, !.got = data[k].bytes])
         ELSE Set(w, k, [Idle EXCEPT !.phase = CLAIMING])
    /\ UNCHANGED <<data, claim, encodes, restarts>>

\* The claim of k: w's start wins if no live claim is there (w holds it for a
\* lease); refused by another's live claim, w waits on it, a lease at most.
Claim(w, k) ==
    /\ ws[w][k].phase = CLAIMING
    /\ IF Free(k)
         THEN Take(w, k)
         ELSE /\ Set(w, k, [Idle EXCEPT !.phase = WAITING, !.timer = Lease, !.rounds = 1,
                                        !.lease = claim[k].left, !.polled = TRUE,
                                        !.missed = Missed(k)])
              /\ UNCHANGED claim
    /\ UNCHANGED <<data, encodes, restarts>>

\* One poll of a waiter: the publish visible to its ask, it loads it; else
\* it claims again, and wins once the claim it found has ended (a takeover:
\* OWNED; a publish the ask missed is loaded by the claimer's second look,
\* Encode).  Refused at its deadline: after ClaimsWaited claims it encodes
\* itself (no claim), else waits one more lease on the newer claim.  (A poll
\* that changes nothing is no step.)
Poll(w, k) ==
    LET s == ws[w][k]
        found == IF Free(k) THEN s.lease ELSE claim[k].left
    IN
    /\ s.phase = WAITING
    /\ \E stored \in Looks(w, k) :
       IF stored
         THEN Set(w, k, [Idle EXCEPT !.phase = DONE, !.got = data[k].bytes]) /\ UNCHANGED claim
       ELSE IF Free(k)
         THEN Take(w, k)
       ELSE IF s.timer = 0 /\ s.rounds = ClaimsWaited
         THEN Set(w, k, [Idle EXCEPT !.phase = FALLBACK]) /\ UNCHANGED claim
       ELSE IF s.timer = 0
         THEN /\ Set(w, k, [s EXCEPT !.timer = Lease, !.rounds = @ + 1, !.lease = found,
                                     !.polled = TRUE, !.missed = Missed(k)])
              /\ UNCHANGED claim
       ELSE /\ ~s.polled \/ s.lease # found \/ s.missed # Missed(k)
            /\ Set(w, k, [s EXCEPT !.lease = found, !.polled = TRUE, !.missed = Missed(k)])
            /\ UNCHANGED claim
    /\ UNCHANGED <<data, encodes, restarts>>

\* The claimer looks at the store once more (another's publish may have
\* become visible since its miss: it loads it) or encodes; a waiter that
\* fell back encodes.
Encode(w, k) ==
    LET s == ws[w][k] IN
    /\ s.phase \in {OWNED, FALLBACK}
    /\ IF s.phase = OWNED /\ data[k].state = COMPLETE
         THEN /\ Set(w, k, [s EXCEPT !.phase = RELEASE, !.got = data[k].bytes])
              /\ UNCHANGED encodes
         ELSE /\ Set(w, k, [s EXCEPT !.phase = PUBLISH, !.got = Enc(k)])
              /\ encodes' = [encodes EXCEPT ![k] = @ + 1]
    /\ UNCHANGED <<data, claim, restarts>>

\* The claimer's encode fails: it releases its claim; its request gets the error.
EncodeFails(w, k) ==
    /\ FAIL \in Faults
    /\ ws[w][k].phase = OWNED
    /\ RemoveClaim(w, k)
    /\ Set(w, k, [Idle EXCEPT !.phase = FAILED])
    /\ UNCHANGED <<data, encodes, restarts>>

\* The put of the bytes: refused if the key exists (a duplicate: someone
\* published, or is publishing, first).
BeginPublish(w, k) ==
    LET s == ws[w][k] IN
    /\ s.phase = PUBLISH
    /\ IF data[k].state = NONE
         THEN /\ data' = [data EXCEPT ![k] = [state |-> WRITING, bytes |-> Garbage, by |-> w]]
              /\ Set(w, k, [s EXCEPT !.phase = PUBLISHING])
         ELSE /\ Set(w, k, AfterPublish(s))
              /\ UNCHANGED data
    /\ UNCHANGED <<claim, encodes, restarts>>

\* The put completes: the object is visible, with w's bytes (unless a restart
\* took it meanwhile).
EndPublish(w, k) ==
    LET s == ws[w][k] IN
    /\ s.phase = PUBLISHING
    /\ data' = IF data[k].state = WRITING /\ data[k].by = w
                 THEN [data EXCEPT ![k] = [state |-> COMPLETE, bytes |-> s.got, by |-> w]]
                 ELSE data
    /\ Set(w, k, AfterPublish(s))
    /\ UNCHANGED <<claim, encodes, restarts>>

\* The claimer releases once the key is stored (its publish, or another's,
\* visible), or once its lease ended by its own clock (a put that was lost).
Release(w, k) ==
    /\ ws[w][k].phase = RELEASE
    /\ data[k].state = COMPLETE \/ ws[w][k].timer = 0
    /\ RemoveClaim(w, k)
    /\ Set(w, k, [ws[w][k] EXCEPT !.phase = DONE, !.own = FALSE, !.timer = 0])
    /\ UNCHANGED <<data, encodes, restarts>>

\* A claimer's process dies mid-encode (SIGKILL): its work on every key ends;
\* its claims stay in the store until their leases end.
Crash(w) ==
    /\ CRASH \in Faults
    /\ \E k \in Keys : ws[w][k].phase = OWNED
    /\ ws' = [ws EXCEPT ![w] = [k \in Keys |->
                 IF ws[w][k].phase \in Terminal THEN ws[w][k] ELSE [Idle EXCEPT !.phase = DEAD]]]
    /\ UNCHANGED <<data, claim, encodes, restarts>>

-----------------------------------------------------------------------------
(* The store and the clock. *)

\* A claim whose lease ended is removed (the master's timeout for abandoned
\* puts, or a worker's clean-up of an expired claim).
Expire(k) ==
    /\ claim[k] # NoClaim
    /\ claim[k].left = 0
    /\ claim' = [claim EXCEPT ![k] = NoClaim]
    /\ UNCHANGED <<data, ws, encodes, restarts>>

\* The master restarts: every claim and object is gone.  Workers find no
\* claim and no object: waiters fall back, claimers publish to the new one.
\* (A waiter's next ask may miss an object published to the new master.)
Restart ==
    /\ RESTART \in Faults
    /\ restarts = 0
    /\ data' = [k \in Keys |-> NoData]
    /\ claim' = [k \in Keys |-> NoClaim]
    /\ restarts' = restarts + 1
    /\ ws' = [w \in Workers |-> [k \in Keys |->
                 IF ws[w][k].phase = WAITING THEN [ws[w][k] EXCEPT !.missed = TRUE]
                 ELSE ws[w][k]]]
    /\ UNCHANGED encodes

\* Time moves on by one tick: every lease and timer counts down.  Not before
\* every waiter polled since the last tick, nor, unless claimers may be slow,
\* while it would end the lease of a claim its owner still encodes or
\* publishes.
Tick ==
    /\ \/ \E k \in Keys : claim[k].left > 0
       \/ \E w \in Workers, k \in Keys : ws[w][k].timer > 0
    /\ \A w \in Workers, k \in Keys : ws[w][k].phase = WAITING => ws[w][k].polled
    /\ SLOW \notin Faults => \A w \in Workers, k \in Keys :
           ws[w][k].own /\ ws[w][k].phase \in {OWNED, PUBLISH, PUBLISHING} => ws[w][k].timer > 1
    /\ claim' = [k \in Keys |-> [claim[k] EXCEPT !.left = Dec(@)]]
    /\ ws' = [w \in Workers |-> [k \in Keys |->
                 IF ws[w][k].phase = WAITING
                   THEN [ws[w][k] EXCEPT !.timer = Dec(@), !.lease = @ - 1, !.polled = FALSE]
                   ELSE [ws[w][k] EXCEPT !.timer = Dec(@)]]]
    /\ UNCHANGED <<data, encodes, restarts>>

\* Every worker is done with every key and no claim is left: the behaviour
\* ends here (a stuttering step, so that TLC's deadlock check still flags
\* any other state where nothing can happen).
Done ==
    /\ \A w \in Workers, k \in Keys : ws[w][k].phase \in Terminal
    /\ \A k \in Keys : claim[k] = NoClaim
    /\ UNCHANGED vars

-----------------------------------------------------------------------------

Init ==
    /\ data = [k \in Keys |-> NoData]
    /\ claim = [k \in Keys |-> NoClaim]
    /\ ws = [w \in Workers |-> [k \in Keys |-> Idle]]
    /\ encodes = [k \in Keys |-> 0]
    /\ restarts = 0

\* One worker's steps on one key (it works on each key in sequence).
Work(w, k) ==
    \/ Claim(w, k) \/ Poll(w, k) \/ Encode(w, k) \/ BeginPublish(w, k) \/ EndPublish(w, k)
    \/ Release(w, k)

Next ==
    \/ \E w \in Workers, k \in Keys : Ask(w, k) \/ Work(w, k) \/ EncodeFails(w, k)
    \/ \E w \in Workers : Crash(w)
    \/ \E k \in Keys : Expire(k)
    \/ Restart
    \/ Tick
    \/ Done

Spec == Init /\ [][Next]_vars

\* Liveness: time moves on, live workers keep working, and expired claims are
\* cleaned up.  Requests arriving (Ask) and failures get no fairness.
LiveSpec ==
    /\ Spec
    /\ WF_vars(Tick)
    /\ \A k \in Keys : WF_vars(Expire(k))
    /\ \A w \in Workers, k \in Keys : WF_vars(Work(w, k))

-----------------------------------------------------------------------------
(* Invariants and properties. *)

Phases == {IDLE, CLAIMING, OWNED, WAITING, FALLBACK, PUBLISH, PUBLISHING, RELEASE, DONE,
           FAILED, DEAD}

TypeOK ==
    /\ data \in [Keys -> {NoData} \cup [state : {WRITING, COMPLETE}, bytes : Keys \cup {Garbage},
                                        by : Workers]]
    /\ claim \in [Keys -> {NoClaim} \cup [owner : Workers, left : 0..Lease]]
    /\ ws \in [Workers -> [Keys -> [phase : Phases, own : BOOLEAN, timer : 0..Lease,
                                    lease : -Lease..Lease, rounds : 0..ClaimsWaited,
                                    polled : BOOLEAN, got : Keys \cup {Garbage, NoBytes},
                                    missed : BOOLEAN]]]
    /\ encodes \in [Keys -> 0..Cardinality(Workers)]
    /\ restarts \in 0..1

\* Every byte a worker holds (and serves) is the encoder's output for its key,
\* and so is every object a later get would load.
NoWrongBytes ==
    /\ \A w \in Workers, k \in Keys : ws[w][k].got \in {NoBytes, Enc(k)}
    /\ \A k \in Keys : data[k].state = COMPLETE => data[k].bytes = Enc(k)

\* A waiter never waits once the lease of the claim it waits on has ended
\* (its poll in the tick the lease ends takes the claim over, or finds a
\* newer one, or the publish).
NoWaitPastLease == \A w \in Workers, k \in Keys : ws[w][k].phase = WAITING => ws[w][k].lease >= 0

\* While a worker holds a claim whose lease is live, no other worker does:
\* the claim is exclusive for its lease.  (Not across a restart: the new
\* master has no claim, and another worker's claim there wins.)
ClaimExclusive ==
    \A k \in Keys : Cardinality({w \in Workers : ws[w][k].own /\ ws[w][k].timer > 0}) <= 1

\* With no failure, each key is encoded at most once across the fleet.
EncodedOnce == \A k \in Keys : encodes[k] <= 1

\* Every waiting request ends: it loads the publish, takes the claim over, or
\* falls back.
WaitEnds == \A w \in Workers, k \in Keys : ws[w][k].phase = WAITING ~> ws[w][k].phase # WAITING

\* Claims are bounded: every claim leaves the store (released or expired).
ClaimsCleaned == \A k \in Keys : claim[k] # NoClaim ~> claim[k] = NoClaim

=============================================================================
