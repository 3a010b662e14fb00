from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('inference', '0005_engine_settings_validated'),
    ]

    operations = [
        migrations.AddField(
            model_name='modeldeployment',
            name='reasoning_parser',
            field=models.CharField(blank=True, choices=[('', 'none (the answer is all content)'), ('qwen3', 'Qwen3 (<think>...</think> opens the answer)'), ('deepseek_r1', 'DeepSeek-R1 (the prompt opens <think>)')], default='', help_text="How a reasoning model's thinking is read apart from its answer: chat completions return it as reasoning_content.", max_length=32),
        ),
    ]
