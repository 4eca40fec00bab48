"""The research protocols behind benchmarks/results (not part of the library): each is a plan and a short function
over the library's public steps (`ats.workflows.runner.Runner`, the answer pool and answer training), run by a
script of benchmarks/ and tested in tests/benchmarks/.

    evidence     issue 12: lr selected on held-out instruction data, controls, paired statistics, the token-vs-task
                 trade-off of the objectives; the data-scaling run
    alignment    an aligned chat model beside a base model, before and after ATS
    answers      issue 21: heads trained on the model's own answers, lr selection on held-out pool folds, leave one
                 task out, seeds and paired intervals on the reported tasks
    answers_report  the answers protocol's markdown, targets and reliability diagrams

Scripts import them as `protocols.<module>` (benchmarks/ is the script's folder, first on sys.path).
"""
