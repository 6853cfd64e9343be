"""An unmodified Gluon training script on MXNet's parameter server (no dpro import), for the benches.

    dpro-launch --engine mxnet -np 2 -H localhost:2 --num-servers 2 python gluon_train.py [--model mlp|cnn]

Every role (scheduler, servers, workers) runs this file; ``import mxnet`` in the scheduler and the servers serves
the job and exits.
"""

import argparse
import time

import mxnet as mx
from mxnet import autograd, gluon, nd

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=("mlp", "cnn", "resnet18"), default="mlp")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--width", type=int, default=1536)
parser.add_argument("--kvstore", default="dist_sync")
parser.add_argument("--hybridize", action="store_true", help="net.hybridize(), as MXNet's examples do")
args = parser.parse_args()

kv = mx.kv.create(args.kvstore)
net = gluon.nn.Sequential()
if args.model == "mlp":
    shape = (args.batch, 784)
    net.add(gluon.nn.Dense(args.width, activation="relu"), gluon.nn.Dense(args.width, activation="relu"),
            gluon.nn.Dense(args.width // 4, activation="tanh"), gluon.nn.Dense(10))
elif args.model == "resnet18":
    shape = (args.batch, 3, 32, 32)
    net = gluon.model_zoo.vision.resnet18_v1(classes=10)
else:
    shape = (args.batch, 3, 32, 32)
    net.add(gluon.nn.Conv2D(32, 3, padding=1, activation="relu"), gluon.nn.BatchNorm(), gluon.nn.MaxPool2D(),
            gluon.nn.Conv2D(64, 3, padding=1, activation="relu"), gluon.nn.MaxPool2D(),
            gluon.nn.Flatten(), gluon.nn.Dense(args.width // 2, activation="relu"), gluon.nn.Dropout(0.2),
            gluon.nn.Dense(10))
net.initialize(mx.init.Xavier())
if args.hybridize:
    net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
x = nd.random.uniform(shape=shape)
y = nd.array([i % 10 for i in range(args.batch)])
began = None
for step in range(args.steps):
    if step == 5:
        nd.waitall()
        began = time.perf_counter()
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(args.batch)
nd.waitall()
if began is not None and kv.rank == 0:
    print(f"gluon_train: {1000 * (time.perf_counter() - began) / (args.steps - 5):.2f} ms/step over steps "
          f"5..{args.steps - 1}", flush=True)
