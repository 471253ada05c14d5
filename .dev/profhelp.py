import sys
sys.path.insert(0,'tests')
import _exact
def prof_run(rank, world, cases):
    import cProfile, pstats, io, time
    pr = cProfile.Profile(); pr.enable()
    t=time.time()
    out = _exact._run_cases(rank, world, cases)
    pr.disable()
    s=io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(50)
    return time.time()-t, s.getvalue()[:9000]
