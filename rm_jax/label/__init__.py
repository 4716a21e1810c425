"""Teacher labelling (launch.label) and label validation (launch.validate_labels).

contracts  the routed judge contracts the teacher reads, with ids and sha256 (label_meta)
request    a Sample -> OpenAI chat requests (verdict head, image head), thumbnails
client     the async teacher pool: AsyncOpenAI per endpoint, bounded concurrency, retries
replies    teacher replies -> verdicts (the training target's tolerant parser), image scores
store      the append-only output keyed by id (resume, torn-line repair), errors, rejects
run        the labelling job: read, route, label, write, stats, progress
validate   the label report: fail rate by similarity to the online reply, by route, issues,
           migration against an earlier labelling; flags other tools read by name
report     a validation report -> report.json, report.md, plots, per-bin examples
"""
