"""``headrace bench serve``: the serving benchmark (a gRPC asyncio client of any headrace server).

workload.py builds the requests, arrivals.py times them, runner.py sends them and records
every chunk's arrival, stats.py turns those timestamps into vLLM-style metrics,
scrape.py samples the server's /metrics meanwhile, report.py and plot.py show the result,
command.py is the CLI around them.
"""
