"""Silent data corruption: replica fingerprints compared across data-parallel ranks
(:mod:`~trainguard.sdc.replicas`), an unstable step done again to tell the hardware from the data
(:mod:`~trainguard.sdc.rerun`), and a suspect rank's step replayed on its partner
(:mod:`~trainguard.sdc.crosscheck`). The Guard's response is :mod:`trainguard.guard.sdc_response`."""
