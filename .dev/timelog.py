import os, time
def pytest_runtest_logfinish(nodeid, location):
    w = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open("/tmp/timelog.txt", "a") as f:
        f.write(f"{time.time():.1f} {w} {nodeid}\n")
