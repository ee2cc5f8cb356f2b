# embedjob on a CUDA PyTorch image. The base must carry torch >= 2.10 (varlen attention)
# and <= 2.14.1; pass another tag with --build-arg BASE=... if your cluster mirrors one.
#   docker build -t embedjob .
#   docker run --gpus all -v $PWD:/work -w /work embedjob run jobs/demo.yaml
ARG BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 \
    EMBEDJOB_CACHE=/cache/embedjob \
    HF_HOME=/cache/huggingface

WORKDIR /opt/embedjob
COPY pyproject.toml README.md ./
COPY embedjob ./embedjob
COPY jobs ./jobs
RUN python -m pip install --no-cache-dir . && python -c "import embedjob.cli, decord"

WORKDIR /work
ENTRYPOINT ["embedjob"]
CMD ["--help"]
