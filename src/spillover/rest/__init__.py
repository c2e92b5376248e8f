"""Operating a running job from outside its process: the job master's REST API with
Flink's paths and checkpoint statistics, Prometheus metrics under Flink's names, a
live dashboard, and the registry under ``SPILLOVER_HOME`` that the lifecycle CLI
(``spillover run | list | savepoint | stop | cancel``) finds jobs in.

    server = serve(create_executor("local", env, config))
    print(server.url)            # GET {url}/jobs/{id}/checkpoints ...
    result = server.job.run()
    server.close()
"""

from spillover.rest.job import ServedJob
from spillover.rest.server import JobServer, serve

__all__ = ["JobServer", "ServedJob", "serve"]
