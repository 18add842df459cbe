"""The model checker's world: the real ``lw.fsm`` endpoints in a simulated P/D cluster.

``world`` (state, actions, safety checks), ``network`` (messages in flight), ``variants``
(d-first, p-first, eager-free), ``properties``
(docs/design.md section 4 and the stuck-state explanation),
``explorer`` (BFS, random walks, fair drain, replay, shrinking), ``clone`` (fast copies),
``trace`` (text and Mermaid counterexamples), ``cli`` (`lw check`, the only module with I/O).
"""
