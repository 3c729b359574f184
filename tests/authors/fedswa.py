"""Conformance fixture: github.com/junkangLiu0/FedSWA at f725be9, ``main_FedSWA.py``, transcribed unmodified: a
client's FedAvg update with its LoRA path (``DataWorker.update_fedavg``, l.548-582, ``--lora 1``), its FedSWA and
FedMoSWA updates (``update_FedSWA``, l.837-862; ``update_FedMoSWA``, l.864-902) and state loader
(``state_id_loader``, l.493-499), and the servers' averages (``apply_weights_avg``, l.1365-1381; ``apply_weights_SCAF``,
l.1390-1428, SCAFFOLD's and MoFedSWA's). The module globals they read (``args``, ``device``, ``selection``, ``alg``,
``c_dict``) are set by the tests that use them (tests/test_lora_conformance.py, tests/test_sam_more.py); a worker's
``data_id_loader`` is the test's (theirs reads CIFAR)."""
# ruff: noqa
# fmt: off
from copy import deepcopy

import torch

args = None
device = torch.device("cpu")
selection = 1.0
alg = "MoFedSWA"
c_dict = {}


class DataWorker(object):

    def state_id_loader(self, index):
        '''
        在每轮的开始，该工人装载状态，以充当被激活的第index个客户端，使用外部的状态字典
        '''
        if not c_dict.get(index):
            return
        self.ci = c_dict[index]

    def update_fedavg(self, weights, E, index, lr):
        self.model.load_state_dict(weights)
        self.model.to(device)
        self.data_id_loader(index)

        for name, param in self.model.named_parameters():
            if "classifier" in name or "head" in name:
                   param.requires_grad = True
        self.optimizer = torch.optim.SGD(filter(lambda p: p.requires_grad, self.model.parameters()), lr=lr, weight_decay=1e-3)
        self.loss = 0
        step = 0  # 新增步数计数
        for e in range(E):
            for batch_idx, (data, target) in enumerate(self.data_iterator):
                if step >= args.K:
                    break
                step += 1  # 步数+1
                data = data.to(device)
                target = target.to(device)
                self.model.zero_grad()
                output = self.model(data)
                loss = self.criterion(output, target)
                self.loss += loss.item() / args.K
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters=self.model.parameters(), max_norm=10)
                self.optimizer.step()
        if args.lora == 1:
            delta_w = {k: v.cpu() for k, v in self.model.state_dict().items() if 'lora' in k or "classifier" in k or "head" in k}
            for k, v in self.model.state_dict().items():
                if 'lora' in k or "classifier" in k or "head" in k:
                    delta_w[k] = v.cpu() - weights[k]
        else:
            delta_w = {k: v.cpu() for k, v in self.model.state_dict().items()}
            for k, v in self.model.state_dict().items():
                delta_w[k] = v.cpu() - weights[k]
        return delta_w

    def update_FedSWA(self, weights, E, index,lr):
        self.model.load_state_dict(weights)
        self.data_id_loader(index)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr*2, weight_decay=1e-3 )
        lr1=lr
        rho=0
        lr2=rho*lr
        i=0
        for e in range(E):
            for batch_idx, (data, target) in enumerate(self.data_iterator):
                i=i+1
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr*2, weight_decay=1e-3 )
                data = data.to(device)
                target = target.to(device)
                self.model.zero_grad()
                output = self.model(data)
                loss = self.criterion(output, target)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters=self.model.parameters(), max_norm=10)
                self.optimizer.step()
                lr=(1-i/(len(self.data_iterator)*E))*lr1+(i/(len(self.data_iterator)*E))*lr2
        self.loss = loss.item()
        delta_w = {k: v.cpu() for k, v in self.model.state_dict().items()}
        for k, v in self.model.state_dict().items():
            delta_w[k] = v.cpu() - weights[k]
        return delta_w

    def update_FedMoSWA(self, weights, E, index, ps_c, lr):
        self.model.load_state_dict(weights)  # y_i = x, x:weights
        if self.ci == {}:
            self.ci = {k: torch.zeros_like(v,device='cpu') for k, v in self.model.named_parameters()}
        if ps_c == {}:
            ps_c = {k: torch.zeros_like(v,device='cpu') for k, v in self.model.named_parameters()}
        self.data_id_loader(index)
        self.state_id_loader(index)
        a1 = lr
        rho=0
        a2 = rho * lr
        i = 0
        for e in range(E):
            for batch_idx, (data, target) in enumerate(self.data_iterator):
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, weight_decay=1e-3)
                i = i + 1
                data = data.to(device)
                target = target.to(device)
                self.model.zero_grad()
                output = self.model(data)
                loss = self.criterion(output, target)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters=self.model.parameters(), max_norm=10)
                self.optimizer.step()  # y_i = y_i-lr*g
                new_weights = deepcopy(self.model.get_weights())
                for k, v in self.model.get_weights().items():
                    new_weights[k] = v - (-self.ci[k] + ps_c[k]) * lr  # y_i = y_i -lr*(-ci + c)
                self.model.set_weights(new_weights)
                lr = (1 - i / (len(self.data_iterator) * E)) * a1 + (i / (len(self.data_iterator) * E)) * a2
        lr = (a1 + a2) / 2
        send_ci = deepcopy(self.model.get_weights())
        for k, v in self.model.get_weights().items():
            self.ci[k] = (weights[k] - v) / (E * len(self.data_iterator) * lr) + self.ci[k] - ps_c[k]
        self.loss = loss.item()
        for k, v in self.model.get_weights().items():
            send_ci[k] = -ps_c[k] + self.ci[k]
        delta_w = {k: v.cpu() for k, v in self.model.state_dict().items()}
        for k, v in self.model.state_dict().items():
            delta_w[k] = v.cpu() - weights[k]
        ci_copy = deepcopy(self.ci)
        c_dict[index] = ci_copy
        return delta_w, send_ci


def apply_weights_avg(num_workers, weights,model):
    model.to('cpu')
    ps_w = {k: v.cpu() for k, v in model.state_dict().items()}
    sum_weights = {}
    for weight in weights:
        for k, v in weight.items():
            if not torch.is_floating_point(ps_w[k]):
                continue
            if k in sum_weights.keys():  # delta_w = \sum (delta_wi/#wk)
                sum_weights[k] += v / (num_workers * selection)
            else:
                sum_weights[k] = v / (num_workers * selection)
    for k, v in sum_weights.items():  # w = w + delta_w
        ps_w[k] = ps_w[k] + sum_weights[k]*args.lg
        #ps_w[k]=ps_w[k]*(1-args.alpha)
    model.load_state_dict(ps_w)
    return {k: v.cpu() for k, v in model.state_dict().items()}


def apply_weights_SCAF(num_workers, weights,model,ps_c):
    model.to('cpu')
    m = [mi for _, mi in weights]
    weightss = [w for w,_ in weights]
    sum_c = {}
    # 首先以第一个客户端为基础初始化 sum_c（避免判断逻辑）
    for k, v in m[0].items():
        sum_c[k] =v / (num_workers * selection)
    # 之后叠加剩余客户端的梯度
    for ci in m[1:]:
        for k, v in ci.items():
            sum_c[k]+= v / (num_workers * selection)
    if ps_c == {}:
        ps_c = {k: torch.zeros_like(v.cpu()) for k, v in model.named_parameters()}
        for k, v in m[0].items():
            ps_c[k]=sum_c[k]
    else:
        for k, v in m[0].items():
            if alg in {'SCAFFOLD'}:
                ps_c[k]=ps_c[k]+sum_c[k]*selection
            else:
                ps_c[k] = ps_c[k] + sum_c[k] * 0.4
    ps_w = model.state_dict()  # w : ps_w

    sum_weights = {}  # delta_w : sum_weights
    for weight in weightss:
        for k, v in weight.items():
            if k in sum_weights.keys():  # delta_w = \sum (delta_wi/#wk)
                sum_weights[k] += v / (num_workers * selection)
            else:
                sum_weights[k] = v / (num_workers * selection)
    for k, v in sum_weights.items():  # w = w + delta_w
        ps_w[k] = ps_w[k] + sum_weights[k]
    model.load_state_dict(ps_w)
    return model.state_dict(),ps_c
