"""Benchmark: what one pair's averaging round costs on the wire, against the bytes its values take.

Two averagers of one stage (``--stage``, of the byte-level model at ``--width`` or of the tiny Llama) run ``--rounds``
rounds of ``--mode`` (``gossip``: PowerGossip; ``powersgd``; ``full``) on random values, each on its own DHT node
announced behind a relay of ``link_emulator`` (a fast link: this counts bytes, not seconds), so that everything the
pair says to each other crosses a relay: matchmaking, the declarations, both phases' parts, the reducers'
statements, the audits (``--audit-rate``), and libp2p's framing of all of it. It prints the bytes a round carried
in each direction and the seconds a round took, beside the payload: the bytes of the values alone, as
``bench_gradients.py`` counts them (hivemind's messages for a group of 2). Their ratio is the round's overhead.

Run::

    python tests/benchmarks/bench_round_wire.py --mode gossip --rounds 30 [--model tiny-llama] [--audit-rate 0]

To compare two versions of the code, run the same command in a ``git worktree`` of each, one after the other
(``PYTHONPATH=<worktree>`` puts its ``client`` ahead of the installed one).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time

import torch
from bench_gradients import gradient_bytes, quick, tiny_llama_run  # this directory
from link_emulator import Relay, dht_behind_relay, parse_link  # this directory
from solders.keypair import Keypair

from client.averaging.gossip import GossipAverager
from client.averaging.gradients import GradAveraging, GradientAverager, GradientSettings
from client.averaging.membership import Membership, Roster
from client.averaging.values import GradValues
from client.pipeline.discovery import start_dht
from client.pipeline.model import ModelConfig, build_stage

FAST_LINK = "10000/1"  # Mbit/s and ms of round trip: bytes are what this counts


def settings(mode: str, rank: int, values: GradValues, audit_rate: float) -> GradientSettings:
    timeouts = dataclasses.replace(quick(0.5), audit_rate=audit_rate, min_group_size=2)
    if mode == "full":
        return GradientSettings(GradAveraging.FULL, timeouts=timeouts)
    return GradientSettings(GradAveraging.POWERSGD, rank=rank, values=values, timeouts=timeouts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["gossip", "powersgd", "full"], default="gossip")
    parser.add_argument("--model", choices=["psyswarm", "tiny-llama"], default="psyswarm")
    parser.add_argument("--width", type=int, default=128, help="d_model of the byte-level model")
    parser.add_argument("--stage", default="body1", help="which stage's parameters the pair averages")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--values", type=GradValues, default=GradValues.INT8, help="codec (not for --mode full)")
    parser.add_argument("--audit-rate", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    config = tiny_llama_run(64)[0] if args.model == "tiny-llama" else ModelConfig(n_layers=3, d_model=args.width,
                                                                                     seq_len=64)
    chosen = settings(args.mode, args.rank, args.values, args.audit_rate)
    relays: list[Relay] = []
    bootstrap = start_dht()
    link = parse_link(FAST_LINK)
    dhts = [dht_behind_relay([str(a) for a in bootstrap.get_visible_maddrs()], link, relays) for _ in range(2)]
    keys = [Keypair(), Keypair()]
    roster = Roster(0, frozenset(bytes(k.pubkey()) for k in keys), frozenset())
    named = [[(n, p.detach().clone()) for n, p in build_stage(config, args.stage).named_parameters()]
             for _ in keys]
    kind = GossipAverager if args.mode == "gossip" else GradientAverager
    averagers = [kind(pairs, dht, run_id="bench-round-wire", stage=args.stage, seed=1, settings=chosen,
                      membership=Membership(key, lambda: roster)) for pairs, dht, key in zip(named, dhts, keys,
                                                                                            strict=True)]
    generator = torch.Generator().manual_seed(0)
    params = [[p + 0.01 * torch.randn(p.shape, generator=generator) for _, p in pairs] for pairs in named]

    def round_of(i: int, index: int, seconds: list[float]) -> None:
        started = time.monotonic()
        if args.mode == "gossip":
            averagers[i].mix(params[i], index, peers=1)
        else:
            grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(index * 2 + i)) for p in params[i]]
            averagers[i].average(grads, 4, index, 4.0, peers=1)
        seconds.append(time.monotonic() - started)

    time.sleep(2.0)  # the DHT's own chatter settles
    before = [relay.bytes_each_way for relay in relays]
    seconds: list[float] = []
    for index in range(args.rounds):
        threads = [threading.Thread(target=round_of, args=(i, index, seconds)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    time.sleep(3.0)  # the last round's audits
    carried = [(up - up0, down - down0) for (up0, down0), (up, down) in zip(
        before, [relay.bytes_each_way for relay in relays], strict=True)]
    one_way = max(max(pair) for pair in carried) / args.rounds
    payload = gradient_bytes(config, chosen, 2, gossip=args.mode == "gossip")[args.stage][1]
    print(f"{args.mode} on {args.model} {args.stage}, {args.rounds} rounds, audit rate {args.audit_rate}: "
          f"{one_way:,.0f} B a round on the busier direction of the pair's link, the values' payload "
          f"{payload:,} B ({one_way / payload:.2f}x); {statistics.median(seconds):.3f} s a round (median)")
    for averager in averagers:
        averager.shutdown()
    for relay in relays:
        relay.stop()


if __name__ == "__main__":
    main()
