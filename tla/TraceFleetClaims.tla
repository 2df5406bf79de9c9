------------------------- MODULE TraceFleetClaims --------------------------
(***************************************************************************)
(* Trace validation of one worker's claims: the events a worker's          *)
(* FleetClaims recorded (its trace= hook) for one key are accepted iff     *)
(* some behaviour of FleetClaims, with the rest of the fleet and the clock *)
(* unobserved, takes exactly those steps of the worker Me at those times. *)
(*                                                                         *)
(* The trace is partial: only Me's claim steps are observed.  Between two  *)
(* events any number of hidden steps may happen: the other workers' steps  *)
(* (Ask, Claim, Poll, Encode, the publish, Release, EncodeFails, Crash),   *)
(* the master's Expire, Me's own publish (BeginPublish, EndPublish) and    *)
(* Me's encode after a fallback (the pipeline's, not the claims'), and     *)
(* time (Tick).  Time is observed: each event carries the tick it         *)
(* happened in (tla/claims_trace.py: its clock reading over the tick's     *)
(* length, a lease / Lease), and `now' counts the ticks taken, so a step   *)
(* happens only in its event's tick.  A tick in which nothing counts down  *)
(* is time passing with no step of the spec (TimePasses).                  *)
(*                                                                         *)
(* Traces is a sequence of traces (one per key of a recorded run); TLC     *)
(* picks one (t) in the initial state and follows it.  Whether a trace is  *)
(* explained is an existential question (the hidden steps are chosen),    *)
(* so TLC explores every state reachable this way and tla/claims_trace.py  *)
(* reads the furthest event each trace reached from the dumped states:     *)
(* the whole trace, accepted; else the first event no behaviour explains.  *)
(*                                                                         *)
(* The event records (fields a, out, n: action, outcome, tick):           *)
(*   Ask miss | hit           Ask(Me, K), to CLAIMING or DONE              *)
(*   Claim won | taken        Claim(Me, K), to OWNED or WAITING            *)
(*   Poll taken               Poll(Me, K) still WAITING, or a poll that    *)
(*                            changes nothing (the spec's Poll not enabled)*)
(*   Poll extended            Poll(Me, K) at the deadline: one more lease  *)
(*   Poll won|loaded|fallback Poll(Me, K) to OWNED, DONE, FALLBACK         *)
(*   Encode encoded | loaded  Encode(Me, K) of a claimer: PUBLISH, RELEASE *)
(*   EncodeFails              EncodeFails(Me, K)                           *)
(*   Release stored|lease|late   Release(Me, K)                            *)
(* Anything else (no master: none, a failed read, a release at close) is   *)
(* outside the spec and explains nothing.                                  *)
(***************************************************************************)
EXTENDS FleetClaims, Sequences

CONSTANTS
    Me,      \* the worker whose trace this is (the others are Workers \ {Me})
    Events,  \* the distinct event records
    Traces   \* a sequence of traces, each a sequence of indices into Events

ASSUME Me \in Workers /\ Cardinality(Keys) = 1

VARIABLES t, i, now   \* the trace followed, the index of its next event, ticks so far

traceVars == <<vars, t, i, now>>

K == CHOOSE k \in Keys : TRUE
Others == Workers \ {Me}
S == ws[Me][K]
After == ws'[Me][K]

\* Me's step as the event says.
Observed(e) ==
    CASE e.a = "Ask" /\ e.out = "miss"    -> Ask(Me, K) /\ After.phase = CLAIMING
      [] e.a = "Ask" /\ e.out = "hit"     -> Ask(Me, K) /\ After.phase = DONE
      [] e.a = "Claim" /\ e.out = "won"   -> Claim(Me, K) /\ After.phase = OWNED
      [] e.a = "Claim" /\ e.out = "taken" -> Claim(Me, K) /\ After.phase = WAITING
      [] e.a = "Poll" /\ e.out = "taken"  ->
            \/ Poll(Me, K) /\ After.phase = WAITING /\ After.rounds = S.rounds
            \/ S.phase = WAITING /\ ~ENABLED Poll(Me, K) /\ UNCHANGED vars
      [] e.a = "Poll" /\ e.out = "extended" -> Poll(Me, K) /\ After.rounds = S.rounds + 1
      [] e.a = "Poll" /\ e.out = "won"      -> Poll(Me, K) /\ After.phase = OWNED
      [] e.a = "Poll" /\ e.out = "loaded"   -> Poll(Me, K) /\ After.phase = DONE
      [] e.a = "Poll" /\ e.out = "fallback" -> Poll(Me, K) /\ After.phase = FALLBACK
      [] e.a = "Encode" /\ e.out = "encoded" -> S.phase = OWNED /\ Encode(Me, K)
                                               /\ After.phase = PUBLISH
      [] e.a = "Encode" /\ e.out = "loaded"  -> S.phase = OWNED /\ Encode(Me, K)
                                               /\ After.phase = RELEASE
      [] e.a = "EncodeFails"                 -> EncodeFails(Me, K)
      [] e.a = "Release" /\ e.out \in {"stored", "lease", "late"} -> Release(Me, K)
      [] OTHER                               -> FALSE

\* The steps nobody observed.
Hidden ==
    \/ \E w \in Others : Ask(w, K) \/ Work(w, K) \/ EncodeFails(w, K) \/ Crash(w)
    \/ S.phase = FALLBACK /\ Encode(Me, K)
    \/ BeginPublish(Me, K) \/ EndPublish(Me, K)
    \/ Expire(K)

Counting ==
    \/ \E k \in Keys : claim[k].left > 0
    \/ \E w \in Workers, k \in Keys : ws[w][k].timer > 0

\* Time moves on one tick, up to the next event's: the spec's Tick, or with
\* nothing counting down, time passing with no step of the spec.
TimePasses(e) ==
    /\ now < e.n
    /\ now' = now + 1
    /\ Tick \/ (~Counting /\ UNCHANGED vars)

TraceInit == Init /\ t \in DOMAIN Traces /\ i = 1 /\ now = 0

TraceNext ==
    /\ i <= Len(Traces[t])
    /\ t' = t
    /\ LET e == Events[Traces[t][i]] IN
       \/ now = e.n /\ Observed(e) /\ i' = i + 1 /\ now' = now
       \/ Hidden /\ UNCHANGED <<i, now>>
       \/ TimePasses(e) /\ UNCHANGED i
=============================================================================
