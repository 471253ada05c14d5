if __name__ == '__main__':
    import cProfile, pstats, io, sys, time
    sys.path.insert(0, "tests"); sys.path.insert(0, ".dev")
    import test_zoo as z
    from _exact import make_cases, reference, run_cases
    import _exact
    t=time.time()
    pr = cProfile.Profile(); pr.enable()
    refs = {b: reference(b, n, z.ADAM_STEPS) for n, b in z.BUILDS.items()}
    pr.disable(); print("refs", time.time()-t)
    s=io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40); print(s.getvalue()[:6000])
    t=time.time()
    pr = cProfile.Profile(); pr.enable()
    cases = make_cases(z.SPECS, z.RATIOS[2], z.ADAM_STEPS, refs)
    pr.disable(); print("compile@2", time.time()-t)
    s=io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:5000])
    
    from profhelp import prof_run
    from _dist import run_ranks
    r = run_ranks(2, prof_run, cases, timeout=900)
    print("rank0", r[0][0]); print(r[0][1])
