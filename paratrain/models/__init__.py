"""Plain single-device models; parallelism is applied from outside."""
from paratrain.models.transformer import GPTModel, Seq2SeqModel, build_model, token_loss_sum

__all__ = ["GPTModel", "Seq2SeqModel", "build_model", "token_loss_sum"]
