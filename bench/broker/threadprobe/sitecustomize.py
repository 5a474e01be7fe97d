"""A thread sampler for a broker process a bench starts, loaded by Python's `site` when this
directory is on the process's PYTHONPATH and THREADPROBE_OUT is set (nothing happens
otherwise; in other processes, such as the bench's simulated nodes, it stops at once):

    THREADPROBE_OUT=/tmp/probe PYTHONPATH=bench/broker/threadprobe \
        .venv/bin/python bench/broker/ingest_match.py --nodes 1000 --prompts 128 ...

Every THREADPROBE_EVERY_S (0.1) seconds, in the broker (a process that imported
graft_fed.broker.answers), each thread's innermost graft_fed frame (file:function:line, and
the frame it is in, such as a lock's wait) is counted, one JSON line per sample to
`<THREADPROBE_OUT>.<pid>.jsonl`: {"t": unix time, "c": {"where <- innermost": threads}}.
`python bench/broker/threadprobe/report.py FILE` prints the timeline. It shows where a
thousand threads wait, and for how long (issue 13, twentieth pass: a round's woken
long-polls queued on the round index's lock). Sampling costs a few ms of the interpreter per
sample with a thousand threads: a diagnosis, not a benchmark.
"""

import json
import os
import sys
import threading
import time


def _sample(out: str, every: float) -> None:
    time.sleep(1.0)
    if "graft_fed.broker.answers" not in sys.modules:
        return  # not the broker
    me = threading.get_ident()
    with open(f"{out}.{os.getpid()}.jsonl", "a") as f:
        while True:
            t = time.time()
            counts: dict[str, int] = {}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                inner = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}"
                where, fr = None, frame
                while fr is not None:
                    if "graft_fed" in fr.f_code.co_filename:
                        where = f"{os.path.basename(fr.f_code.co_filename)}:{fr.f_code.co_name}:{fr.f_lineno}"
                        break
                    fr = fr.f_back
                key = f"{where} <- {inner}" if where else inner
                counts[key] = counts.get(key, 0) + 1
            f.write(json.dumps({"t": t, "c": counts}) + "\n")
            f.flush()
            time.sleep(every)


if os.environ.get("THREADPROBE_OUT"):
    threading.Thread(target=_sample, args=(os.environ["THREADPROBE_OUT"],
                                           float(os.environ.get("THREADPROBE_EVERY_S", "0.1"))),
                     daemon=True, name="threadprobe").start()
