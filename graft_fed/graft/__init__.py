"""GRAFT on top of the GRPO trainer: one step function, peers behind one interface.

    step.py      the GRAFT step (docs/algorithm.md steps 1-13), written once
    receive.py   the receiver's side: re-verify, re-tokenise, score, gate (steps 7-10)
    stored.py    peers = a stored run's trajectories ("Stored peers")
    cotrain.py   peers = models co-trained in this process, and the co-training runner
The third kind of peers, a federation's broker over gRPC, is graft_fed/node/peers.py.
"""
