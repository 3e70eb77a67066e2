"""Ad-hoc: the offload JPEG shape, raydl-auto only, with every process's CPU per batch over the measured epoch."""
import os, sys, time, gc
HERE = os.path.dirname(os.path.abspath(__file__)); REPO = os.path.dirname(HERE); EX = os.path.join(REPO, "examples")
sys.path.insert(0, HERE); sys.path.insert(0, EX)
import _common as C
import bench_images as B
import bench_offload as O
import torch
import train_image_classifier as T
import psutil
lane = os.environ.get("LANE", "1") == "1"
data_dir = "/tmp/raydl-bench-images/500x375-n1536-c100-q90"
ds = T.JpegFolder(data_dir, T.TrainTransform(224))
pythonpath = os.pathsep.join([REPO, EX])
cluster = C.LocalCluster("/tmp/raydl-probe-off", 6791, 8791, env={"RAYDL_CLUSTER_HEAD_CPUS": "1", "RAYDL_CLUSTER_OBJECT_STORE_BYTES": "500000000", "PYTHONPATH": pythonpath})
step = O.TrainStep(float(os.environ.get("STEP_MS", "224")))
def snap():
    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        try:
            ct = p.info["cpu_times"]; cmd = " ".join(p.info["cmdline"] or [])[:80]
            aff = p.cpu_affinity()
            out[p.info["pid"]] = (p.info["name"], cmd, aff, ct.user + ct.system)
        except Exception:
            pass
    return out
try:
    O.start_cluster(cluster, 2)
    import ray, raydl
    from ray import cloudpickle
    for mod in (T, B, sys.modules[__name__]):
        cloudpickle.register_pickle_by_value(mod)
    loader = raydl.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, persistent_workers=True, ray_lane=lane)
    me = psutil.Process()
    for ep in range(3):
        if ep == 2:
            s0 = snap(); th0 = {t.id: t.user_time + t.system_time for t in me.threads()}; t0 = time.perf_counter()
        n = 0; st = 0.0; nx = 0.0
        itr = iter(loader)
        while True:
            c = time.thread_time()
            try:
                batch = next(itr)
            except StopIteration:
                break
            c2 = time.thread_time(); nx += c2 - c
            step(batch); st += time.thread_time() - c2; n += 1
            del batch
        if ep == 2:
            t1 = time.perf_counter(); s1 = snap(); th1 = {t.id: t.user_time + t.system_time for t in me.threads()}
    print(f"main thread: step {st/n*1e3:.1f} ms/batch, next() {nx/n*1e3:.1f} ms/batch")
    it = loader._iterator
    print(f"lane={lane} images/s {n*64/(t1-t0):.1f}  ms/batch {(t1-t0)/n*1e3:.1f}  lane calls {it._calls.lane_calls} / {it._sched.calls_sent}")
    rows = []
    for pid, (name, cmd, aff, c1) in s1.items():
        c0 = s0.get(pid, (0, 0, 0, 0))[3]
        d = (c1 - c0) / n * 1e3
        if d > 0.3:
            rows.append((d, pid, name, aff, cmd))
    for d, pid, name, aff, cmd in sorted(rows, reverse=True):
        print(f"{d:8.1f} ms/batch  cpu{aff} {name:16s} {cmd}")
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid, c in th1.items():
        d = (c - th0.get(tid, 0)) / n * 1e3
        if d > 0.3:
            print(f"   driver thread {tid} {names.get(tid, '?'):24s} {d:7.1f} ms/batch")
    loader.shutdown()
finally:
    C.disconnect_and_stop(cluster)
