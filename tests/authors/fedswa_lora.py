"""Conformance fixture: github.com/junkangLiu0/FedSWA at f725be9, ``main_FedSWA.py``: the LoRA path (``--lora 1``)
of a client's FedAvg update (``DataWorker.update_fedavg``, l.548-582) and FedSWA update (``update_FedSWA``,
l.837-862), and the server's average (``apply_weights_avg``, l.1365-1381), transcribed unmodified. The module
globals they read (``args``, ``device``, ``selection``) are set by tests/test_lora_conformance.py; the worker's
``data_id_loader`` is the test's (theirs reads CIFAR)."""
# ruff: noqa
# fmt: off
import torch

args = None
device = torch.device("cpu")
selection = 1.0


class DataWorker(object):

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
