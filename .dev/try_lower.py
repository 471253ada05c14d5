import time, hapd, warnings, cProfile, pstats
from hapd.compiler.normalize import normalize
from hapd.models.zoo import ZOO
warnings.filterwarnings("ignore")
for name in ["gpt2","t5","resnet18"]:
    m, inp = ZOO[name](batch=8)
    p = hapd.export(m, inp)
    n = normalize(p)
    hapd.lower(n, name=name)
    t=time.time(); ir = hapd.lower(n, name=name); print(name, "lower", time.time()-t, len(n.graph.nodes))
m, inp = ZOO["t5"](batch=8); p = hapd.export(m, inp); n = normalize(p)
pr=cProfile.Profile(); pr.enable(); hapd.lower(n, name="t5"); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(15)
