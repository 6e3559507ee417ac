"""Why training stops and saves: signals with a hard deadline (:mod:`~trainguard.stop.signals`),
the memory watchdog (:mod:`~trainguard.stop.memory`), and the stop and save conditions every rank
agrees on at a step boundary (:mod:`~trainguard.stop.conditions`)."""
