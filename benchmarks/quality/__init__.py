"""Time to quality on slow links: phalanx's strategies side by side with torch's (and torchft's), on tasks that take
minutes.

Modules: :mod:`.corpus` (the GPT's text), :mod:`.gpt` and :mod:`.tasks` (what is trained and
measured), :mod:`.setups` (who trains it; :mod:`.torchft_peer` for torchft's DiLoCo), :mod:`.plan`
(what runs), :mod:`.worker` (one worker process), :mod:`.curves` (time to target), :mod:`.report`
(tables and plots), :mod:`.advisor` (checks `phalanx bench`'s advice) and :mod:`.cli` (the command).
"""
