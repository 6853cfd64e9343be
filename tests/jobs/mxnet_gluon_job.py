"""A plain Gluon job on a dist_sync kvstore (MXNet's ps-lite parameter server) that knows nothing of dpro (used by
tests). Every role runs this file: in the scheduler and the servers ``import mxnet`` serves and exits.

    dpro-launch --engine mxnet -np 2 -H localhost:2 --num-servers 2 python mxnet_gluon_job.py [--steps 8]
"""

import argparse
import os

import mxnet as mx
from mxnet import autograd, gluon, nd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--fail-at", type=int, default=-1, help="worker 1 dies (status 3) at this step")
args = parser.parse_args()

kv = mx.kv.create("dist_sync")
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(10))
net.initialize(mx.init.Xavier())
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
x = nd.random.uniform(shape=(32, 20))
y = nd.array([i % 10 for i in range(32)])
for step in range(args.steps):
    if step == args.fail_at and kv.rank == 1:
        os._exit(3)  # dies: an exception would leave it waiting in ps-lite's shutdown for the others
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(32)
nd.waitall()
print(f"mxnet worker {kv.rank} of {kv.num_workers} done, "
      f"loss {loss.mean().asscalar():.3f}", flush=True)
