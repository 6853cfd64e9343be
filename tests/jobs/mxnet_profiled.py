"""A Gluon job on a dist_sync kvstore recorded by ``dpro.plugins.mxnet.Profiler`` (used by tests). Every role runs
this file: in the scheduler and the servers ``import mxnet`` serves and exits.

    dpro-launch --engine mxnet --no-profile -np 2 -H localhost:2 --num-servers 2 \
        python mxnet_profiled.py RUN_DIR [--steps 14] [--window 4:10] [--hybridize] [--fail-at K] [--again RUN_DIR2]
"""

import argparse
import os

import mxnet as mx
from mxnet import autograd, gluon, nd

from dpro.plugins.mxnet import Profiler

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--steps", type=int, default=14)
parser.add_argument("--window", default="4:10")
parser.add_argument("--hybridize", action="store_true")
parser.add_argument("--fail-at", type=int, default=-1, help="worker 1 dies (status 3) at this step")
parser.add_argument("--again", default=None, help="then record a second window (8 more steps) into this run dir")
args = parser.parse_args()
start, stop = (int(v) for v in args.window.split(":"))

kv = mx.kv.create("dist_sync")
net = gluon.nn.HybridSequential()
with net.name_scope():
    features = gluon.nn.HybridSequential()
    features.add(gluon.nn.Conv2D(8, 3, activation="relu"), gluon.nn.MaxPool2D(), gluon.nn.Conv2D(16, 3))
    net.add(features, gluon.nn.Flatten(), gluon.nn.Dense(32, activation="relu"), gluon.nn.Dense(10))
net.initialize(mx.init.Xavier())
if args.hybridize:
    features.hybridize()  # one cached graph for the two convolutions
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
x = nd.random.uniform(shape=(8, 3, 16, 16))
y = nd.array([i % 10 for i in range(8)])


def train(steps: int, prof: Profiler) -> None:
    for step in range(steps):
        if step == args.fail_at and kv.rank == 1:
            os._exit(3)  # dies: an exception would leave it waiting in ps-lite's shutdown for the others
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(8)
        prof.step()


with Profiler(net, trainer, run_dir=args.run_dir, steps=range(start, stop), batch_size=8) as prof:
    train(args.steps, prof)
if args.again:
    with Profiler(net, trainer, run_dir=args.again, steps=range(4, 8), batch_size=8) as prof:
        train(8, prof)
nd.waitall()
print(f"mxnet worker {kv.rank} of {kv.num_workers} done", flush=True)
